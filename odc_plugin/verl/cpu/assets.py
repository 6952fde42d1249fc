"""Everything a GRPO run on a laptop needs, made offline and cached: a tiny model and its data set, a text
model (a Qwen2 or a Qwen3-MoE with word problems, text_assets.py) or a vision-language one (a Qwen2.5-VL
with pictures, vl_assets.py), `MODELS`.

The warm-started models are shipped in the package (`SHIPPED`, ~0.5 MB each), not built on the user's
machine: 400 warm-start steps amplify the last bit of a float sum, which torch's kernels, MKL's and
oneDNN's code paths, glibc's maths and the thread count each set per CPU, so a build gave other weights
on an AVX512 machine with AMX, at AVX2, with one thread or two, and on an AMD EPYC even with all of those
pinned, and the golden metrics (`tests/verl/golden.py`) held only where they had been made.
`python -m odc_plugin.verl.cpu.assets --refresh` warm-starts them again (then refresh the golden files).
`ensure_assets` puts a model and its data set in a cache (`ODC_VERL_CACHE`, default ~/.cache/odc-verl)
that verl reads, and replaces a cached model that is not the shipped one; a finished cache entry is moved
into place whole, so a crash leaves no half-written one.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import text_assets, vl_assets

# Bump when the data set's making changes: old caches are then ignored.
VERSION = 3
# The warm-started models, one folder per model as transformers saves it (weights, config, tokenizer).
SHIPPED = Path(__file__).with_name("tiny_models")
# a vision-language model of Qwen2.5-VL's architecture, with its processor and a data set of pictures (vl_assets.py)
VL_MODEL = "qwen2_5_vl"
MODELS = ("qwen2", "qwen3_moe", VL_MODEL)


@dataclass(frozen=True)
class Assets:
    model_dir: str  # tiny model + tokenizer (a processor for the vision-language one), loadable by verl
    train_file: str  # parquet, verl's GSM8K layout (geo3k's, with images, for the vision-language model)
    val_file: str
    vision_language: bool = False


def cache_root() -> str:
    return os.environ.get("ODC_VERL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "odc-verl")


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A model's weights, hashed in name order (its safetensors file's bytes would also hash the writer's
    metadata): what the golden metrics start from."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(os.path.join(model_dir, "model.safetensors")).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def refresh(model: str, out: Path | None = None, steps: int = 400, seed: int = 0) -> str:
    """Warm-start `model` again on this machine and write it to `out` (default: over its shipped folder);
    returns its fingerprint."""
    out = out or SHIPPED / model
    built, tokens = (
        vl_assets.warm_started(steps, seed) if model == VL_MODEL else text_assets.warm_started(model, steps, seed)
    )
    shutil.rmtree(out, ignore_errors=True)
    for part in (built, built.generation_config, tokens):  # tokens: the tokenizer, or the processor around it
        part.save_pretrained(out)
    return model_fingerprint(out)


def _cached_model_is_shipped(model_dir: str, model: str) -> bool:
    shipped = SHIPPED / model
    names = sorted(p.name for p in shipped.iterdir())
    return (
        os.path.isdir(model_dir)
        and sorted(os.listdir(model_dir)) == names
        and all(filecmp.cmp(shipped / name, os.path.join(model_dir, name), shallow=False) for name in names)
    )


def ensure_assets(root: str | None = None, log=print, model: str = "qwen2") -> Assets:
    """The cached assets with `model` (one of MODELS): the shipped model and the data set, written first if
    missing or if the cached model is not the shipped one."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")
    root = root or cache_root()
    final = os.path.join(root, f"grpo-cpu-v{VERSION}" if model == "qwen2" else f"grpo-cpu-{model}-v{VERSION}")
    assets = Assets(
        os.path.join(final, "model"),
        os.path.join(final, "train.parquet"),
        os.path.join(final, "test.parquet"),
        vision_language=model == VL_MODEL,
    )
    if not (_cached_model_is_shipped(assets.model_dir, model) and os.path.isfile(assets.val_file)):
        os.makedirs(root, exist_ok=True)
        log(f"writing the tiny {model} model and its data set to {final}")
        staging = tempfile.mkdtemp(prefix=".writing-", dir=root)
        stale = f"{staging}.stale"
        try:
            shutil.copytree(SHIPPED / model, os.path.join(staging, "model"))
            _write_data(model, staging)
            if os.path.isdir(final):
                os.rename(final, stale)
            os.rename(staging, final)
        except OSError:
            if not os.path.isdir(final):  # not a concurrent writer that finished first
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)
    return assets


def _write_data(model: str, directory: str) -> None:
    """The training and validation parquet files of `model`'s job."""
    kind = vl_assets if model == VL_MODEL else text_assets
    train, val = kind.split_problems()
    kind.write_parquet(train, os.path.join(directory, "train.parquet"), "train")
    kind.write_parquet(val, os.path.join(directory, "test.parquet"), "test")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}",
        description="Warm-start the shipped tiny models again on this machine (then refresh the golden files: "
        "python -m tests.verl.golden).",
        allow_abbrev=False,
    )
    parser.add_argument("--refresh", action="store_true", required=True, help="rewrite the shipped models")
    parser.add_argument("--model", choices=MODELS, nargs="+", default=list(MODELS))
    args = parser.parse_args(argv)
    for model in args.model:
        print(f"{model}: {SHIPPED / model}, model {refresh(model)}")


if __name__ == "__main__":
    main()
