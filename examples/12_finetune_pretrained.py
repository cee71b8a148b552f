"""Fine-tune a Hugging Face checkpoint with the pipeline: convert, train, generate, export.

The steps, each one ``nnx-mpmd`` command (run here as subprocesses):

1. ``nnx-mpmd convert --from-hf HF --run-dir R -- TRAIN-OPTIONS``: the Hugging
   Face directory (``config.json`` + ``model.safetensors`` [+ ``tokenizer.json``])
   becomes a run directory with a checkpoint of step 0;
2. ``nnx-mpmd train --resume --run-dir R TRAIN-OPTIONS``: a pipelined fine-tune
   (2 stages on 2 meshes) on a text file, tokenized with ``--tokenizer``;
3. ``nnx-mpmd generate --run-dir R --prompt T --max-tokens N``: samples from it;
4. ``nnx-mpmd convert --run-dir R --to-hf OUT``: exports the fine-tuned weights,
   which ``transformers`` (or `nnx_mpmd.models.load_pretrained`) loads.

By default the checkpoint is the tiny randomly initialised Llama that
``transformers`` wrote into tests/fixtures/hf_llama_tiny (``--hf-dir`` takes any
GPT-2 or Llama directory), and the text file is a slice of the Python standard
library. Where this installation lacks ``--dataset``/``--tokenizer`` or the
``generate`` subcommand, the example says so and uses the built-in character
tokenizer and the Python API (`nnx_mpmd.apps.sampling.generate_text`) instead.

Run:  python examples/12_finetune_pretrained.py --steps 4
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

import nnx_mpmd as mp
from nnx_mpmd.apps import cli
from nnx_mpmd.apps.train import build_parser as train_parser

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_HF = REPO / "tests" / "fixtures" / "hf_llama_tiny"


def nnx_mpmd(*args: str) -> str:
    """Runs one ``nnx-mpmd`` command, shows its output, and returns it."""
    print(f"$ nnx-mpmd {' '.join(args)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "nnx_mpmd", *args], capture_output=True, text=True)
    print(proc.stdout.rstrip())
    if proc.returncode != 0:
        sys.exit(f"nnx-mpmd {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def write_tokenizer(text_file: pathlib.Path, vocab_size: int, out: pathlib.Path) -> bool:
    """Trains a small BPE ``tokenizer.json`` on the text (needs ``tokenizers``)."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        print("tokenizers is not installed (pip install 'nnx-mpmd[data]'): no tokenizer.json")
        return False
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"])
    tokenizer.train([str(text_file)], trainer)
    tokenizer.save(str(out))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hf-dir", type=pathlib.Path, default=DEFAULT_HF)
    parser.add_argument("--work", type=pathlib.Path, default=None, help="default: a temp dir")
    args = parser.parse_args()
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="finetune-"))
    os.environ.setdefault("NNX_MPMD_COMPILE_CACHE", str(work / "cache"))
    mp.enable_compile_cache()

    # The text to fine-tune on, and a copy of the checkpoint to add a tokenizer to.
    from nnx_mpmd.apps.data import stdlib_corpus

    text_file = work / "text.txt"
    text_file.write_text(stdlib_corpus(20_000))
    hf_dir = work / "hf"
    shutil.copytree(args.hf_dir, hf_dir, dirs_exist_ok=True)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]

    train_flags = train_parser()._option_string_actions
    has_data_flags = "--dataset" in train_flags and "--tokenizer" in train_flags
    options = [
        *("--meshes", "2", "--data", "1", "--batch-size", "4", "--microbatches", "2"),
        *("--seq-len", "16", "--steps", str(args.steps), "--warmup", "1", "--lr", "1e-3"),
        *("--log-every", "1", "--sample-tokens", "0", "--val-batches", "1"),
    ]
    if has_data_flags and not (hf_dir / "tokenizer.json").exists():
        write_tokenizer(text_file, vocab, hf_dir / "tokenizer.json")
    if has_data_flags:
        options += ["--dataset", str(text_file)]  # tokenizer.json is picked up by itself
    else:
        print("this installation has no --dataset/--tokenizer: training on the built-in corpus")
        options += ["--corpus-bytes", "20000"]

    run_dir = work / "run"
    nnx_mpmd("convert", "--from-hf", str(hf_dir), "--run-dir", str(run_dir), "--", *options)
    nnx_mpmd("train", "--resume", "--run-dir", str(run_dir), *options)

    if "generate" in cli.SUBCOMMANDS:
        nnx_mpmd("generate", "--run-dir", str(run_dir), "--prompt", "def ", "--max-tokens", "12")
    exported = work / "exported"
    nnx_mpmd("convert", "--run-dir", str(run_dir), "--to-hf", str(exported))

    from nnx_mpmd.models import load_pretrained

    model = load_pretrained(exported, num_stages=1)
    if "generate" not in cli.SUBCOMMANDS:
        print("this installation has no 'nnx-mpmd generate': sampling with the Python API")
        from nnx_mpmd.apps.sampling import generate_text
        from nnx_mpmd.apps.text_tokenizers import tokenizer_from_dict
        from nnx_mpmd.checkpoint import CheckpointManager

        manager = CheckpointManager(run_dir / "checkpoints")
        tokenizer = tokenizer_from_dict(manager.metadata()["tokenizer"], run_dir)
        manager.close()
        print(repr(generate_text(model, tokenizer, "def ", 12, temperature=0.8)))

    import safetensors.numpy

    before = safetensors.numpy.load_file(str(args.hf_dir / "model.safetensors"))
    after = safetensors.numpy.load_file(str(exported / "model.safetensors"))
    assert sorted(before) == sorted(after), "the export has other tensors than the checkpoint"
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert changed, "fine-tuning changed no tensor"
    print(f"{len(changed)} of {len(before)} tensors changed by fine-tuning; exported to {exported}")
    print(
        f"the exported checkpoint loads back: {type(model).__name__}, {model.config.n_layers} layers"
    )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
