"""A real text corpus that every machine has offline: the Python standard library's own source files,
as bytes (token = byte, vocabulary 256). Split by file, so no held-out text is ever trained on."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8: the training files, concatenated
    heldout: torch.Tensor  # uint8: the held-out files, concatenated
    train_files: int
    heldout_files: int
    root: str


def stdlib_corpus(heldout_every: int = 10) -> Corpus:
    """Top-level `*.py` files of the standard library, sorted by name; every `heldout_every`-th is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < 2 * heldout_every:
        raise RuntimeError(f"too few standard-library sources under {root} ({len(files)} files)")
    held = [f for i, f in enumerate(files) if i % heldout_every == 0]
    train = [f for i, f in enumerate(files) if i % heldout_every]

    def stream(paths):
        return torch.frombuffer(bytearray(b"".join(p.read_bytes() for p in paths)), dtype=torch.uint8)

    return Corpus(stream(train), stream(held), len(train), len(held), str(root))


def random_windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


def spread_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` windows evenly spread over the stream: a fixed evaluation set."""
    starts = torch.linspace(0, len(stream) - length - 1, count).long()
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()
