"""Does a saved model translate the same without this package as with it? (docs/compatibility.md)

    python scripts/check_without_package.py MODEL_DIR SOURCES OUTPUT_DIR [--python PYTHON ...]

Translates SOURCES (one sentence per line) with `generate()` through the package in this environment, then, under
each PYTHON (default: this one), without the package as a Hub user does (`trust_remote_code=True`, the saved
code): with `generate()` and with `pipeline("translation")`. Every run uses the model's own generation config and
the same batches, and writes `OUTPUT_DIR/<run>.txt`; `OUTPUT_DIR/report.json` says, for each run, the
transformers release and whether the file is byte-identical to the package's. Exits 1 if any is not.
"""

import argparse
import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

BATCH_SIZE = 50  # the same consecutive batches in every run: padding alone must not change a translation


def translate(loader: str, model_dir: str, sources: str, output: str) -> None:
    """Translate `sources` into `output` with `loader`: "package", "remote" (generate) or "pipeline"."""
    import transformers
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

    if loader == "package":
        import vaswani_transformer  # noqa: F401  (registers the Auto classes)
    remote = loader != "package"
    lines = Path(sources).read_text(encoding="utf-8").splitlines()
    if loader == "pipeline":
        translator = pipeline("translation", model=model_dir, trust_remote_code=True)
        translations = [result["translation_text"] for result in translator(lines, batch_size=BATCH_SIZE)]
    else:
        model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, trust_remote_code=remote).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=remote)
        translations = []
        for start in range(0, len(lines), BATCH_SIZE):
            batch = tokenizer(lines[start : start + BATCH_SIZE], padding=True, return_tensors="pt")
            translations += tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True)
    Path(output).write_text("".join(f"{line}\n" for line in translations), encoding="utf-8")
    print(transformers.__version__)


def without_package(python: str, loader: str, model_dir: str, sources: str, output: Path) -> str:
    """Run `translate` under `python` with its libraries but not this package (`-S`: no editable-install hook)."""
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    result = subprocess.run(
        [python, "-S", __file__, "--run", loader, model_dir, sources, str(output)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": purelib},
    )  # fmt: skip
    if result.returncode != 0:
        sys.exit(f"{python} ({loader}) failed:\n{result.stderr[-3000:]}")
    return result.stdout.split()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("sources")
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--python", action="append", help="an interpreter of another environment (repeatable)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # a child: translate with this loader, nothing else
    arguments = parser.parse_args()
    if arguments.run:
        translate(arguments.run, arguments.model_dir, arguments.sources, str(arguments.output_dir))
        return 0
    arguments.output_dir.mkdir(parents=True, exist_ok=True)
    reference = arguments.output_dir / "package.txt"
    translate("package", arguments.model_dir, arguments.sources, str(reference))
    report = []
    for index, python in enumerate(arguments.python or [sys.executable]):
        for loader in ("remote", "pipeline"):
            output = arguments.output_dir / f"{loader}-{index}.txt"
            version = without_package(python, loader, arguments.model_dir, arguments.sources, output)
            identical = filecmp.cmp(reference, output, shallow=False)
            report.append(
                dict(python=python, transformers=version, loader=loader, file=output.name, identical=identical)
            )
            print(f"transformers {version}, {loader} without the package: {'identical' if identical else 'DIFFERS'}")
    (arguments.output_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(run["identical"] for run in report) else 1


if __name__ == "__main__":
    sys.exit(main())
