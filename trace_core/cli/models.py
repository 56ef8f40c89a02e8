"""Pretrained models: ``trace-rl model import`` (GGUF in, HF directory out), ``trace-rl model
check`` (what a model will do in the loop, before a GPU cluster is paid for) and ``trace-rl
model upload`` (an HF directory to the S3 prefix a pipeline's ``base_model_uri`` names).

    trace-rl model import smollm2 --output models/smollm2
    trace-rl model check models/smollm2 --task calc --json build/model-check.json
    trace-rl model upload models/smollm2 s3://mlpipeline/models/smollm2
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trace_core.cli.output import console, write_json
from trace_core.envs.suites import TASK_HELP

app = typer.Typer(
    help="Pretrained models: import a GGUF file, check a model before training, upload one."
)


@app.command("import")
def import_command(
    source: Annotated[
        str,
        typer.Argument(help="smollm2 (SmolLM2-135M-Instruct, from the models extra) or a .gguf"),
    ],
    output: Annotated[Path, typer.Option(help="New folder for the HF directory.")],
) -> None:
    """Write an HF directory (safetensors, config, tokenizer, chat template) from a GGUF file."""
    from trace_core.policy.importer import import_gguf

    with console.status(f"importing {source}"):
        model = import_gguf(source, output)
    console.print(
        f"{model.architecture}, {model.parameters:,} parameters (fp32), vocabulary "
        f"{model.vocab_size:,}, chat template {'yes' if model.has_chat_template else 'no'}"
    )
    console.print(f"wrote {output}; next: trace-rl model check {output} --task calc")


@app.command("check")
def check_command(
    model: Annotated[Path, typer.Argument(help="HF model directory.")],
    task: Annotated[
        str,
        typer.Option(help=TASK_HELP),
    ] = ("calc"),
    data: Annotated[str | None, typer.Option(help="Dataset path/URI (loader tasks).")] = None,
    samples: Annotated[int, typer.Option(help="First turns sampled for the parse rate.")] = 64,
    max_tokens: Annotated[int, typer.Option(help="Generated tokens per turn at most.")] = 256,
    micro_tokens: Annotated[
        int, typer.Option(help="Tokens per update pass for the memory estimate.")
    ] = 8192,
    thinking: Annotated[bool, typer.Option(help="Qwen3-family thinking on.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the prompts and the sampling.")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Template exactness, stop ids, action parse rate, logprob gap, size and memory."""
    from trace_core.envs.suites import make_suite
    from trace_core.policy.checkpoint import check_checkpoint
    from trace_core.train.model_check import check_model

    check_checkpoint(model, "MODEL")
    suite = make_suite(task, data, seed)
    with console.status(f"checking {model} on {task}"):
        report = check_model(model, suite, samples, max_tokens, seed, micro_tokens, thinking)
    table = Table(title=f"{model} on {task}")
    table.add_column("check")
    table.add_column("result", justify="right")
    exact = "yes" if report.template_exact else f"[red]no[/red]: {report.template_mismatch}"
    rows = [
        (
            "architecture",
            f"{report.architecture}, {report.parameters:,} parameters, {report.dtype}",
        ),
        ("chat template", f"{report.template}; observations as {report.observation_role}"),
        (f"template_exact ({report.conversations} conversations)", exact),
        (
            "stop ids",
            ", ".join(f"{i} {t}" for i, t in zip(report.stop_ids, report.stop_tokens, strict=True)),
        ),
        (f"action_parse_rate ({report.samples} samples)", f"{report.action_parse_rate:.3f}"),
        ("cut by --max-tokens", f"{report.truncated_rate:.3f}"),
        (f"logprob_gap (max abs, {report.engine} engine)", f"{report.logprob_gap:.2e}"),
        (
            f"update memory estimate ({report.micro_tokens} tokens/pass, CUDA, checkpointing)",
            f"{report.memory_gib['total']:.1f} GiB",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    write_json(json_path, report.to_json())


@app.command("upload")
def upload_command(
    folder: Annotated[
        Path, typer.Argument(metavar="DIR", help="HF model directory (safetensors weights).")
    ],
    uri: Annotated[
        str, typer.Argument(metavar="URI", help="s3://bucket/prefix holding nothing yet.")
    ],
) -> None:
    """Upload an HF directory (config, tokenizer, safetensors) where a pipeline's
    base_model_uri reads it; a prefix that holds files is refused, never written over."""
    from trace_core.cli.output import progress
    from trace_core.train.base_model import upload_model
    from trace_core.train.progress import LineProgress

    lines: list[LineProgress] = []  # made once the upload knows its size
    with progress() as bar:
        task = bar.add_task(f"uploading {folder}", total=None)

        def sent(done: int, total: int) -> None:
            megabytes = max(1, total >> 20)
            bar.update(task, completed=done >> 20, total=megabytes)
            if not console.is_terminal:
                if not lines:
                    lines.append(LineProgress("upload", megabytes, "MB"))
                lines[0](min(megabytes, done >> 20) if done < total else megabytes)

        files, size = upload_model(folder, uri, sent)
    where = uri.rstrip("/")
    said = {"markup": False, "highlight": False, "soft_wrap": True}
    console.print(f"uploaded {files} files ({size / 1e6:.1f} MB) from {folder} to {where}", **said)
    console.print("the pipeline's parameter (trace-rl pipeline run, schedule, step prep):")
    console.print(f"  --param base_model_uri={where}", **said)
