"""The matrix's models, from a linear classifier to ResNet-20. Plain ``nn.Module``s."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .data import CONTEXT, IMAGE_CLASSES, VOCAB_SIZE


def logreg() -> nn.Module:
    """Multinomial logistic regression on the 64 digit pixels (650 parameters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def mlp() -> nn.Module:
    """Two hidden layers of 256 on the digit pixels (~83k parameters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def lenet() -> nn.Module:
    """LeNet-5 style CNN for 3x32x32 images (~62k parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 -> 28 -> 14
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 14 -> 10 -> 5
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, IMAGE_CLASSES),
    )


class CharRNN(nn.Module):
    """Embedding -> one recurrent layer (GRU or LSTM) -> per-position logits."""

    def __init__(self, cell: str, embed: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, embed)
        self.rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[cell](embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB_SIZE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


def char_gru() -> nn.Module:
    return CharRNN("gru")


def char_lstm() -> nn.Module:
    return CharRNN("lstm")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTNano(nn.Module):
    """A tiny GPT: token + position embeddings, 2 blocks of width 64 with 4 heads, tied head (~105k parameters)."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, d)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pos = nn.Parameter(torch.zeros(1, CONTEXT, d))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def gpt_nano() -> nn.Module:
    return GPTNano()


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet20(nn.Module):
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks (16/32/64 channels), ~0.27M parameters."""

    def __init__(self, classes: int = IMAGE_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def resnet20() -> nn.Module:
    return ResNet20()
