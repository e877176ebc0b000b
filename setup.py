"""Build hook for flodl's one optional C extension; everything else is in pyproject.toml.

``flodl.wire._framec`` is the compiled half of the frame codec (``flodl/wire/_framec.c``): it is
``optional``, so a machine without a C compiler installs flodl all the same and the codec runs its
pure-Python path (the same bytes, slower on the round trip; ``flodl.wire.codec.NATIVE`` says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("flodl.wire._framec", ["flodl/wire/_framec.c"], optional=True, extra_compile_args=["-O2"])])
