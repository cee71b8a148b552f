"""Fine-tune a Hugging Face checkpoint with the pipeline: convert, train, generate, export.

The steps, each one ``nnx-mpmd`` command (run here as subprocesses):

1. ``nnx-mpmd convert --from-hf HF --run-dir R -- TRAIN-OPTIONS``: the Hugging
   Face directory (``config.json`` + ``model.safetensors`` + ``tokenizer.json``)
   becomes a run directory with a checkpoint of step 0 and the train options in
   ``R/config.toml``;
2. ``nnx-mpmd train --resume --run-dir R``: a pipelined fine-tune (2 stages on 2
   meshes) on a text file (``--dataset``), tokenized with the checkpoint's
   ``tokenizer.json``; the options come back from ``R/config.toml``;
3. ``nnx-mpmd generate --run-dir R --prompt T --max-tokens N``: greedy text from
   the fine-tuned model, decoded with that tokenizer;
4. ``nnx-mpmd convert --run-dir R --to-hf OUT``: exports the fine-tuned weights
   and the tokenizer, which ``transformers`` (or `nnx_mpmd.models.load_pretrained`)
   loads.

By default the checkpoint is the tiny randomly initialised Llama that
``transformers`` wrote into tests/fixtures/hf_llama_tiny (``--hf-dir`` takes any
GPT-2 or Llama directory), and the text file is a slice of the Python standard
library. The fixture has no tokenizer, so the example trains a small byte-level
BPE ``tokenizer.json`` on the text with the ``tokenizers`` package, its
vocabulary within the checkpoint's 96 ids. Needs ``pip install 'nnx-mpmd[data,hf]'``.

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


def write_tokenizer(text_file: pathlib.Path, vocab_size: int, out: pathlib.Path) -> None:
    """Trains a byte-level BPE ``tokenizer.json`` of at most ``vocab_size`` ids on the text.

    Its alphabet is limited to the 48 most frequent characters so that about as many
    merges (tokens of several characters) fit; other characters become ``<unk>``.
    ``<|endoftext|>`` ends each document.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, limit_alphabet=48, special_tokens=["<unk>", "<|endoftext|>"]
    )
    tokenizer.train([str(text_file)], trainer)
    # Every id the model can emit decodes: the tokenizer fills the checkpoint's vocabulary.
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    tokenizer.save(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hf-dir", type=pathlib.Path, default=DEFAULT_HF)
    parser.add_argument("--work", type=pathlib.Path, default=None, help="default: a temp dir")
    args = parser.parse_args()
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="finetune-"))
    os.environ.setdefault("NNX_MPMD_COMPILE_CACHE", str(work / "cache"))
    mp.enable_compile_cache()

    # The text to fine-tune on, and a copy of the checkpoint with a tokenizer.json.
    from nnx_mpmd.apps.data import stdlib_corpus

    text_file = work / "text.txt"
    text_file.write_text(stdlib_corpus(20_000))
    hf_dir = work / "hf"
    shutil.copytree(args.hf_dir, hf_dir, dirs_exist_ok=True)
    if not (hf_dir / "tokenizer.json").exists():
        vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
        write_tokenizer(text_file, vocab, hf_dir / "tokenizer.json")
    options = [
        *("--meshes", "2", "--data", "1", "--batch-size", "4", "--microbatches", "2"),
        *("--seq-len", "16", "--steps", str(args.steps), "--warmup", "1", "--lr", "1e-3"),
        *("--log-every", "1", "--sample-tokens", "0", "--val-batches", "1"),
        *("--dataset", str(text_file)),  # the checkpoint's tokenizer.json is taken along
    ]

    run_dir = work / "run"
    nnx_mpmd("convert", "--from-hf", str(hf_dir), "--run-dir", str(run_dir), "--", *options)
    nnx_mpmd("train", "--resume", "--run-dir", str(run_dir))  # options: run/config.toml
    prompt, new_tokens = "def ", 8
    generated = nnx_mpmd(
        *("generate", "--run-dir", str(run_dir), "--prompt", prompt),
        *("--max-tokens", str(new_tokens), "--meshes", "1"),
    )
    exported = work / "exported"
    nnx_mpmd("convert", "--run-dir", str(run_dir), "--to-hf", str(exported))

    # The export loads back, and greedy decoding of it continues the prompt as generate did.
    from nnx_mpmd.apps.sampling import generate
    from nnx_mpmd.apps.text_tokenizers import HFTokenizer
    from nnx_mpmd.models import load_pretrained

    model = load_pretrained(exported, num_stages=1)
    tokenizer = HFTokenizer(exported / "tokenizer.json")
    ids = generate(model, tokenizer, prompt, new_tokens, temperature=0.0)
    text = tokenizer.decode(ids)
    assert generated.rstrip("\n") == text.rstrip("\n"), f"generate and the export differ: {text!r}"

    import safetensors.numpy

    before = safetensors.numpy.load_file(str(args.hf_dir / "model.safetensors"))
    after = safetensors.numpy.load_file(str(exported / "model.safetensors"))
    assert sorted(before) == sorted(after), "the export has other tensors than the checkpoint"
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert changed, "fine-tuning changed no tensor"
    print(f"{len(changed)} of {len(before)} tensors changed by fine-tuning; exported to {exported}")
    print(
        f"the exported checkpoint loads back: {type(model).__name__}, {model.config.n_layers} "
        f"layers; its greedy text equals nnx-mpmd generate's: {text!r}"
    )
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
