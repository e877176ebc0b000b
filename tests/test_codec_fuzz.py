"""The project's own fuzzing of the frame codec: compiled against Python, and under the sanitizers.

``tests/helpers/codec_fuzz.py`` makes seeded cases (valid signed frames of every kind, mutated in their
bytes, their structure or their header, signed again) and holds the compiled reader to the Python
one on each. Here: a few thousand cases in this process, and the same fuzz in a subprocess whose
``flodl.wire._framec`` is built with ``-fsanitize=address,undefined`` (ASan's runtime preloaded, the
interpreter's small-object allocator off so every bytes object has ASan's red zones around it): a read
past a frame's end or an undefined operation ends that process with the sanitizer's report. Skipped,
saying why, where there is no compiler, no ASan runtime or no Python headers. About 30 s on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from flodl.config.env import pure_codec_requested
from flodl.wire import codec

from .helpers import codec_fuzz

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "flodl" / "wire" / "_framec.c"
SEED = 20261207  # fixed: a failure names its case, and the same seed gives the same cases
native = pytest.mark.skipif(not codec.NATIVE, reason="flodl.wire._framec is not built here (no compiler, or FLODL_PURE_CODEC)")


@native
def test_the_compiled_and_python_readers_agree_on_mutated_signed_frames():
    out = codec_fuzz.run(SEED, 4000)
    assert not out.disagreements, "\n".join(out.disagreements[:5])
    # the cases reach every outcome: accepted (much of it by the compiled half), and each kind of drop a
    # peer with the secret can cause; a fuzz whose frames all died at the tag would compare nothing
    assert out.accepted > 500 and out.compiled > 200, out.as_json()
    wanted = {"truncated", "oversized", "unknown_version", "bad_tag", "unknown_kind", "malformed", "schema", "wrong_run", "replayed"}
    assert wanted <= set(out.drops), out.as_json()


def test_the_cases_are_the_seeds_and_a_disagreement_is_seen():
    assert list(codec_fuzz.frames(5, 300)) == list(codec_fuzz.frames(5, 300))
    assert list(codec_fuzz.frames(5, 300)) != list(codec_fuzz.frames(6, 300))
    # the comparison can fail: a reader of another run drops what the other accepts
    frame = next(f for what, f in codec_fuzz.frames(5, 300) if codec_fuzz.pure_reader().read(f) is not None)
    _, why = codec_fuzz.same_outcome(codec_fuzz.pure_reader(run_id="another-run"), codec_fuzz.pure_reader(), frame)
    assert why is not None and "python" in why


# ---------------------------------------------------------------- the sanitizer build


def _compiler() -> str:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    found = shutil.which(cc) or shutil.which("gcc") or shutil.which("cc")
    if found is None:
        pytest.skip("no C compiler (cc, gcc) on PATH: the sanitizer build of flodl.wire._framec needs one")
    return found


def _asan_runtime(cc: str) -> str:
    """The ASan runtime ``cc`` links against, to preload into an interpreter that was not built with it."""
    out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30).stdout.strip()
    if not os.path.isabs(out) or not os.path.exists(out):
        pytest.skip(f"{cc} has no AddressSanitizer runtime (libasan.so; gcc's libasan package): cannot run the sanitizer build")
    return os.path.realpath(out)


def _sanitizer_build(cc: str, source: Path, into: Path) -> Path:
    """``source`` built as ``_framec`` with ASan and UBSan (every UB report fatal) into ``into``."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        pytest.skip(f"no Python headers (Python.h in {include}): cannot build the extension")
    target = into / f"_framec{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = [cc, "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
    res = subprocess.run(
        [*cmd, "-fPIC", "-shared", f"-I{include}", str(source), "-o", str(target)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, f"the sanitizer build failed:\n{res.stderr[-3000:]}"
    return target


def _fuzz_under_asan(framec: Path, runtime: str, cases: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FLODL_PURE_CODEC"}
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        LD_PRELOAD=runtime,
        # Python's own allocations are not leaks to judge here; a report exits 86 (ASan) or 87 (UBSan)
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:exitcode=86",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87",
        PYTHONMALLOC="malloc",  # every bytes object from malloc, with red zones: a read past a frame's end is seen
    )
    argv = [sys.executable, "-m", "tests.helpers.codec_fuzz", "--framec", str(framec), "--seed", str(SEED), "--cases", str(cases)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.timeout(240)
def test_the_fuzz_runs_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    if pure_codec_requested():
        pytest.skip("FLODL_PURE_CODEC asks for the pure-Python codec")
    cc = _compiler()
    runtime = _asan_runtime(cc)
    res = _fuzz_under_asan(_sanitizer_build(cc, SOURCE, tmp_path), runtime, 6000)
    report = [ln for ln in res.stderr.splitlines() if "Sanitizer" in ln or "runtime error" in ln]
    assert res.returncode == 0 and not report, f"exit {res.returncode}:\n" + "\n".join(report[:20]) + "\n" + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["cases"] == 6000 and out["disagreement_count"] == 0 and out["compiled"] > 200, out

    # the harness sees what it is there to see: the same source with its bounds check loosened by 64
    # bytes (a read up to 48 bytes past a frame's end) is stopped by ASan within those cases
    broken = tmp_path / "broken"
    broken.mkdir()
    check = "return (uint64_t)(c->end - c->p) >= n;"
    text = SOURCE.read_text()
    assert text.count(check) == 1, "the bounds check this test loosens has changed: update the test"
    (broken / "_framec.c").write_text(text.replace(check, "return (uint64_t)(c->end - c->p) + 64 >= n;"))
    res = _fuzz_under_asan(_sanitizer_build(cc, broken / "_framec.c", broken), runtime, 6000)
    assert res.returncode == 86 and "AddressSanitizer: heap-buffer-overflow" in res.stderr, (res.returncode, res.stderr[-3000:])
