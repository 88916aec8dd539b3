# tapesac.data — the offline text corpus (Jane Austen's novels), a byte-level tokenizer, and seeded batches.
#
# Contract:
# - Nothing is read at import: no files, no environment. `find_corpus()` looks for the corpus only when
#   called: an explicit `root` argument, else the TAPESAC_CORPUS environment variable (read inside the
#   call), else `<repo>/../shared/data/austen` where <repo> is the repository root found from this file's
#   location and from the current directory. It returns None when nothing is found; `AustenData` raises
#   `CorpusNotFoundError` (a FileNotFoundError) listing every place it looked.
# - The files: Jane Austen's six novels as plain UTF-8 text, one per novel (emma.txt, mansfieldpark.txt,
#   northangerabbey.txt, persuasion.txt, prideprejudice.txt, sensesensibility.txt; about 4 MB). Public domain
#   (Project Gutenberg's texts); Debian's r-cran-janeaustenr package ships them as R data. The repository keeps a
#   copy beside it in shared/data/austen (its README gives the checksums); the wheel does not ship them.
# - Split: train = emma, mansfieldpark, northangerabbey, prideprejudice, sensesensibility; validation =
#   persuasion. Texts are held as uint8 tensors of their UTF-8 bytes.
# - ByteTokenizer: ids 0..255 are bytes, 256/257/258 are BOS/EOS/PAD; vocab_size = 259. decode() drops
#   the special ids and replaces invalid UTF-8.
# - Batches: int64 `input_ids` of shape [batch_size, seq_len], windows of raw bytes that never cross a
#   document boundary, drawn from a torch.Generator seeded with `seed`: the same (corpus, seq_len,
#   batch_size, seed) gives the same batch stream on every machine. `val_batches(n)` is deterministic and
#   independent of the training stream (evenly spaced, non-overlapping windows where the text allows).
# - `license_corpus()` is the fallback when the Austen files are absent: the licence texts Debian ships in
#   /usr/share/common-licenses (GPL-3 held out for validation, the other files for training).
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = [
    "AUSTEN_TRAIN",
    "AUSTEN_VAL",
    "AustenData",
    "ByteTokenizer",
    "CorpusNotFoundError",
    "TextData",
    "corpus_candidates",
    "find_corpus",
    "license_corpus",
]

AUSTEN_TRAIN = (
    "emma.txt",
    "mansfieldpark.txt",
    "northangerabbey.txt",
    "prideprejudice.txt",
    "sensesensibility.txt",
)
AUSTEN_VAL = ("persuasion.txt",)
CORPUS_ENV = "TAPESAC_CORPUS"
LICENSES_DIR = Path("/usr/share/common-licenses")
LICENSES_VAL = "GPL-3"


class CorpusNotFoundError(FileNotFoundError):
    """The text corpus is not where tapesac looked; the message lists the places."""


def _repo_roots() -> list[Path]:
    """Candidate repository roots: from this file (python/tapesac/data.py) and from the current directory."""
    roots: list[Path] = []
    here = Path(__file__).resolve()
    if len(here.parents) > 2 and here.parents[1].name == "python":
        roots.append(here.parents[2])
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current directory was removed
        cwd = None
    if cwd is not None:
        marked = [p for p in (cwd, *cwd.parents) if (p / ".git").exists() or (p / "pyproject.toml").exists()]
        roots.append(marked[0] if marked else cwd)
    unique: list[Path] = []
    for r in roots:
        if r not in unique:
            unique.append(r)
    return unique


def _is_austen_dir(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in AUSTEN_TRAIN + AUSTEN_VAL)


def corpus_candidates(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Every directory find_corpus(root) would try, in order (for error messages)."""
    if root is not None:
        return [Path(root).expanduser()]
    env = os.environ.get(CORPUS_ENV)
    out = [Path(env).expanduser()] if env else []
    out += [r.parent / "shared" / "data" / "austen" for r in _repo_roots()]
    return out


def find_corpus(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The Austen corpus directory (holding all six *.txt files), or None.

    With `root`, only that directory is checked. Without it: $TAPESAC_CORPUS if set, then
    `<repo>/../shared/data/austen` for the repository root found from this file and from the CWD.
    """
    for cand in corpus_candidates(root):
        if _is_austen_dir(cand):
            return cand.resolve()
    return None


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes are ids 0..255; BOS=256, EOS=257, PAD=258 (vocab_size 259)."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_tensor(self, text: str, add_bos: bool = False, add_eos: bool = False) -> torch.Tensor:
        """int64 tensor [len] of the ids of `text`."""
        return torch.tensor(self.encode(text, add_bos, add_eos), dtype=torch.int64)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in 0..{self.vocab_size - 1}, got {bad[:5]}")
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def _read_bytes(path: Path) -> torch.Tensor:
    data = path.read_bytes()
    if not data:
        raise ValueError(f"corpus file {path} is empty; expected text")
    # bytearray: torch.frombuffer needs a writable buffer to avoid a warning.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class TextData:
    """Seeded random windows over a set of training documents, plus fixed validation windows.

    train / val: one uint8 tensor per document (its UTF-8 bytes). Each document must be at least
    seq_len bytes long. Iterating yields int64 input_ids [batch_size, seq_len] forever.
    """

    def __init__(
        self,
        train: Sequence[torch.Tensor],
        val: Sequence[torch.Tensor],
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        name: str = "text",
        source: str = "",
        val_label: str = "validation text",
    ) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len}, batch_size={batch_size}")
        for split, docs in (("train", train), ("val", val)):
            if not docs:
                raise ValueError(f"{name}: the {split} split has no documents")
            short = [len(d) for d in docs if len(d) < seq_len]
            if short:
                raise ValueError(
                    f"{name}: every {split} document must hold >= seq_len={seq_len} bytes, found one of "
                    f"{short[0]} bytes; use a smaller --seq"
                )
        self.train = [d.to(torch.uint8) for d in train]
        self.val = [d.to(torch.uint8) for d in val]
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.name = name
        self.source = source
        self.val_label = val_label
        self.tokenizer = ByteTokenizer()
        self.vocab_size = ByteTokenizer.vocab_size
        # Valid window starts per document: 0..len-seq_len; a global start index maps to (doc, offset).
        counts = torch.tensor([len(d) - seq_len + 1 for d in self.train], dtype=torch.int64)
        self._ends = torch.cumsum(counts, 0)  # [docs]
        self._starts_total = int(self._ends[-1])
        self._gen = torch.Generator().manual_seed(seed)

    @property
    def train_bytes(self) -> int:
        return sum(len(d) for d in self.train)

    @property
    def val_bytes(self) -> int:
        return sum(len(d) for d in self.val)

    def sample(self) -> torch.Tensor:
        """The next training batch: int64 [batch_size, seq_len]."""
        idx = torch.randint(self._starts_total, (self.batch_size,), generator=self._gen)  # [batch]
        docs = torch.searchsorted(self._ends, idx, right=True)  # [batch]
        rows = []
        for i, d in zip(idx.tolist(), docs.tolist()):
            off = i - (int(self._ends[d - 1]) if d > 0 else 0)
            rows.append(self.train[d][off : off + self.seq_len])
        return torch.stack(rows).to(torch.int64)  # [batch, seq]

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.sample()

    def val_batches(self, n: int) -> list[torch.Tensor]:
        """n deterministic validation batches, int64 [batch_size, seq_len] each.

        The n * batch_size windows are spread evenly over the validation text (non-overlapping when it is
        long enough), so the same n always gives the same batches, whatever was sampled before.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        want = n * self.batch_size
        if want == 0:
            return []
        text = torch.cat(self.val) if len(self.val) > 1 else self.val[0]
        last = len(text) - self.seq_len  # >= 0, checked in __init__
        starts = torch.linspace(0, last, want).round().to(torch.int64).tolist() if want > 1 else [0]
        rows = torch.stack([text[s : s + self.seq_len] for s in starts]).to(torch.int64)  # [want, seq]
        return list(rows.view(n, self.batch_size, self.seq_len).unbind(0))

    def describe(self) -> str:
        return (
            f"{self.name} ({self.source}): train {len(self.train)} docs {self.train_bytes:,} bytes, "
            f"val {len(self.val)} docs {self.val_bytes:,} bytes"
        )


class AustenData(TextData):
    """Jane Austen's novels: five books to train, persuasion.txt held out for validation."""

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        seed: int = 0,
    ) -> None:
        found = find_corpus(root)
        if found is None:
            looked = "\n  ".join(str(p) for p in corpus_candidates(root))
            raise CorpusNotFoundError(
                "the Austen corpus was not found; expected a directory holding "
                f"{', '.join(AUSTEN_TRAIN + AUSTEN_VAL)}. Looked in:\n  {looked}\n"
                f"Fix: pass its directory explicitly (demo: --corpus DIR), or set {CORPUS_ENV}=/path/to/austen. "
                "The files are Jane Austen's six novels as plain UTF-8 text (public domain: Project Gutenberg's "
                "texts; Debian's r-cran-janeaustenr package ships them as R data), one file per novel named as above "
                "(the top of tapesac/data.py, installed with tapesac, says more)."
            )
        self.root = found
        super().__init__(
            train=[_read_bytes(found / f) for f in AUSTEN_TRAIN],
            val=[_read_bytes(found / f) for f in AUSTEN_VAL],
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            name="austen",
            source=str(found),
            val_label="persuasion",
        )


def license_corpus(
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    root: str | os.PathLike[str] = LICENSES_DIR,
) -> TextData:
    """Fallback corpus: the licence texts of Debian's base-files (/usr/share/common-licenses).

    GPL-3 is the validation document; every other regular file (symlinks skipped: they duplicate) trains.
    Tiny (~0.25 MB) and repetitive, so losses are not comparable with Austen's.
    """
    root = Path(root)
    files = sorted(p for p in root.glob("*") if p.is_file() and not p.is_symlink()) if root.is_dir() else []
    val = [p for p in files if p.name == LICENSES_VAL]
    train = [p for p in files if p.name != LICENSES_VAL]
    if not val or not train:
        raise CorpusNotFoundError(
            f"fallback corpus not found: expected {root}/{LICENSES_VAL} and other licence files "
            f"(Debian's base-files), found {len(files)} files in {root}"
        )
    train_t = [t for t in (_read_bytes(p) for p in train) if len(t) >= seq_len]
    return TextData(
        train=train_t,
        val=[_read_bytes(p) for p in val],
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        name="common-licenses",
        source=str(root),
        val_label=LICENSES_VAL,
    )
