"""``python -m recipes.bert_benchmark``: BERT sentence-classification epoch-time table, per optimizer.

    python -m recipes.bert_benchmark                          # CPU preset, HF Trainer front end
    python -m recipes.bert_benchmark --frontend both          # + fairseq-train rows
    python -m recipes.bert_benchmark --preset bert-base --frontend both      # on a GPU
    python -m recipes.bert_benchmark --train-file SST-2/train.tsv --valid-file SST-2/dev.tsv --model ./bert-base-uncased
    torchrun --nproc_per_node 2 -m recipes.bert_benchmark --bagua-algorithm bytegrad

Writes ``results.md`` (the table, also printed), ``results.json`` and ``epoch_time.png`` to
``--out-dir`` (default ``results/bert_benchmark/<preset>``). See docs/recipes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional, Sequence

from .data import SyntheticSpec, WordTokenizer, generate_split, make_vocabulary, read_tsv, write_tsv
from .presets import PRESETS, Preset, get_preset
from .report import SEED_REFERENCE, add_speedups, markdown_table, write_json, write_png
from .results import RowResult, describe_hardware, hardware
from .rows import DEFAULT_ROWS, ROWS, parse_rows

__all__ = ["main", "build_parser", "parse_args"]

FRONTENDS = ("hf", "fairseq", "both", "fsdp")
MAX_SEED = 2**32 - 1  # numpy's and HF's set_seed's limit


def _whole_number(low: int, high: Optional[int] = None, why: str = ""):
    """An argparse type: an integer in ``[low, high]``; argparse names the flag in front of the message."""
    allowed = f"a whole number from {low} to {high}" if high is not None else f"a whole number >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}{why}, got {text!r}")
        return value

    return parse


def _positive_number(text: str) -> float:
    """An argparse type: a finite float > 0 (not 0, negative, nan or inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


_positive_int = _whole_number(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.bert_benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model/data/training size: 'cpu' (default, a few minutes on a laptop CPU), "
                        "'bert-base' (BERT-base, for GPUs), 'tiny' (seconds; smoke test)")
    parser.add_argument("--frontend", choices=FRONTENDS, default=None,
                        help="HF Trainer (hf, default), fairseq-train (fairseq), both, or fsdp: a plain PyTorch loop "
                        "over the model sharded by FSDP2's fully_shard (CPU gloo by default; torchrun for several processes)")
    parser.add_argument("--fsdp", action="store_true", help="the same as --frontend fsdp")
    parser.add_argument("--rows", default=None,
                        help=f"comma-separated rows; 'default' stands for the default rows "
                        f"({','.join(DEFAULT_ROWS)}: BertAdam with its defaults -- per-parameter clipping, its own "
                        f"warmup/t_total schedule -- as Bagua's benchmark ran it, and torch AdamW), 'all' for every row "
                        f"({','.join(ROWS)}). The bertadam-globalclip* rows run BertAdam without its clipping and "
                        f"schedule, the front end clipping globally and scheduling instead (the recipe's earlier "
                        f"BertAdam rows), e.g. --rows default,bertadam-globalclip,bertadam-globalclip-fused-compiled")
    parser.add_argument("--out-dir", default=None, help="where results go (default results/bert_benchmark/<preset>)")
    data = parser.add_argument_group("data and model (default: generated data, model built from the preset)")
    data.add_argument("--train-file", default=None, help="GLUE-style TSV with 'sentence' and 'label' columns (e.g. SST-2 train.tsv)")
    data.add_argument("--valid-file", default=None, help="GLUE-style TSV for the final accuracy (e.g. SST-2 dev.tsv)")
    data.add_argument("--model", default=None,
                      help="local HF checkpoint directory (config, weights, tokenizer) for the HF front end; "
                      "never downloaded")
    size = parser.add_argument_group("overrides of the preset")
    size.add_argument("--epochs", type=_positive_number, default=None,
                      help="epochs to train; a fraction (e.g. 0.1) trains part of an epoch and extrapolates the epoch time")
    size.add_argument("--batch-size", type=_positive_int, default=None, help="per device")
    size.add_argument("--lr", type=_positive_number, default=None)
    size.add_argument("--train-size", type=_positive_int, default=None, help="generated training sentences")
    size.add_argument("--valid-size", type=_positive_int, default=None, help="generated validation sentences")
    size.add_argument("--max-seq-len", type=_whole_number(3, why=" ([CLS], [SEP] and at least one word)"), default=None,
                      help="tokens per sentence incl. [CLS]/[SEP]")
    run = parser.add_argument_group("run")
    run.add_argument("--seed", type=_whole_number(0, MAX_SEED), default=0,
                     help="model init, data order and generated data")
    run.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    run.add_argument("--threads", type=_positive_int, default=None,
                     help="CPU threads for torch (default: torch's choice). On a machine shared with other jobs, "
                     "--threads 1 gives far steadier timings")
    run.add_argument("--bagua-algorithm", default=None,
                     help="Bagua communication algorithm for multi-process runs (torchrun / accelerate launch; "
                     "fairseq: --nproc): gradient_allreduce, bytegrad, decentralized, bmuf, ...")
    run.add_argument("--bagua-algorithm-args", default=None, metavar="JSON",
                     help="the algorithm's keyword arguments as a JSON object, e.g. '{\"sync_interval_ms\": 0}' "
                     "(fairseq rows: each becomes --bagua-<name> VALUE)")
    run.add_argument("--nproc", type=_positive_int, default=None,
                     help="fairseq front end: processes for fairseq-train (default: the recipe's own world size)")
    run.add_argument("--fairseq-timeout", type=_positive_number, default=None, help="seconds per fairseq-train row")
    run.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return parser


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rank_world():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def load_data(args, preset: Preset):
    """``(train, valid, tokenizer_or_None, description)``."""
    if (args.train_file is None) != (args.valid_file is None):
        raise SystemExit("error: --train-file and --valid-file go together")
    if args.train_file is not None:
        train, valid = read_tsv(args.train_file), read_tsv(args.valid_file)
        tokenizer = None if args.model else WordTokenizer.from_examples(train, max_words=preset.vocab_size - 4)
        description = (f"files: {args.train_file} ({len(train)} sentences), {args.valid_file} ({len(valid)} sentences)"
                       + ("" if args.model else f"; word-level vocabulary of the {len(tokenizer)} most frequent "
                          "training words (incl. specials)"))
        return train, valid, tokenizer, description
    spec = SyntheticSpec(
        vocab_words=preset.vocab_size - 4,
        polar_words=preset.polar_words,
        min_words=preset.min_words,
        max_words=preset.max_words,
    )
    train = generate_split(spec, preset.train_size, seed=1000 + args.seed)
    valid = generate_split(spec, preset.valid_size, seed=2000 + args.seed)
    fillers, positive, negative = make_vocabulary(spec)
    tokenizer = None if args.model else WordTokenizer(positive + negative + fillers)
    description = (
        f"generated (recipes.bert_benchmark.data, seeds {1000 + args.seed}/{2000 + args.seed}): {len(train)} train / "
        f"{len(valid)} validation sentences of {spec.min_words}-{spec.max_words} words over {spec.vocab_words} "
        f"words, label = the polarity ({spec.polar_words} words each) that occurs more often, "
        f"{spec.label_noise:.0%} label noise (chance 0.5, best about {1 - spec.label_noise:.2f})"
    )
    return train, valid, tokenizer, description


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, with the checks one flag's type cannot make (argparse errors, exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fsdp and args.frontend not in (None, "fsdp"):
        parser.error(f"--fsdp (the same as --frontend fsdp) contradicts --frontend {args.frontend}: "
                     "pass only one of them")
    args.frontend = "fsdp" if args.fsdp else args.frontend or "hf"
    if args.model is not None and not os.path.isdir(args.model):
        parser.error(f"--model {args.model} is not a directory: it must be a local HF checkpoint directory "
                     "(config, weights, tokenizer); nothing is downloaded")
    if args.rows is not None and args.rows.strip() and not [k for k in args.rows.split(",") if k.strip()]:
        parser.error(f"--rows {args.rows!r} names no row: name at least one, e.g. --rows default")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    rank, world = _rank_world()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    preset = get_preset(args.preset).with_overrides(
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, train_size=args.train_size,
        valid_size=args.valid_size, max_seq_len=args.max_seq_len,
    )
    try:
        rows = parse_rows(args.rows)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.bagua_algorithm:
        from bagua_integrations.distributed import list_algorithms

        if args.bagua_algorithm not in list_algorithms():
            raise SystemExit(f"error: unknown --bagua-algorithm {args.bagua_algorithm!r}; choose from {list(list_algorithms())}")
    algorithm_args = {}
    if args.bagua_algorithm_args:
        if not args.bagua_algorithm:
            raise SystemExit("error: --bagua-algorithm-args needs --bagua-algorithm")
        try:
            algorithm_args = json.loads(args.bagua_algorithm_args)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"error: --bagua-algorithm-args is not JSON ({exc})") from None
        if not isinstance(algorithm_args, dict):
            raise SystemExit("error: --bagua-algorithm-args must be a JSON object of keyword arguments")
    frontends = ["hf", "fairseq"] if args.frontend == "both" else [args.frontend]
    out_dir = args.out_dir or os.path.join("results", "bert_benchmark", preset.name)
    train, valid, tokenizer, data_description = load_data(args, preset)
    num_labels = max(e.label for e in list(train) + list(valid)) + 1
    started = time.time()
    hw = hardware()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        if args.train_file is None:
            write_tsv(os.path.join(out_dir, "data", "train.tsv"), train)
            write_tsv(os.path.join(out_dir, "data", "valid.tsv"), valid)
        print(f"# BERT benchmark, preset {preset.name}: {', '.join(frontends)} x {len(rows)} rows; "
              f"{describe_hardware(hw)}", flush=True)
        print(f"# data: {data_description}", flush=True)

    results: List[RowResult] = []
    title = f"BERT sentence classification, preset '{preset.name}'" + (f", {world} processes" if world > 1 else "")

    def payload(final: bool):
        return {
            "recipe": "recipes.bert_benchmark",
            "complete": final,
            "command": " ".join([os.path.basename(sys.executable), "-m", "recipes.bert_benchmark"] + list(argv if argv is not None else sys.argv[1:])),
            "preset": preset.to_dict(),
            "frontends": frontends,
            "rows": [r.to_dict() for r in results],
            "data": data_description,
            "model": args.model or "built from the preset's config (random init, seed %d)" % args.seed,
            "world_size": world,
            "bagua_algorithm": args.bagua_algorithm,
            "bagua_algorithm_args": algorithm_args,
            "precision": args.precision,
            "threads": args.threads,
            "hardware": hw,
            "seed_reference": SEED_REFERENCE,
            "wall_seconds": round(time.time() - started, 1),
        }

    def on_result(result: RowResult) -> None:
        results.append(result)
        if rank == 0:
            write_json(os.path.join(out_dir, "results.json"), payload(final=False))
            if result.status == "ok":
                print(f"  -> epoch {_num(result.epoch_time_s, '.2f')} s, optimizer step "
                      f"{_num(result.optimizer_step_ms, '.1f')} ms ({_num(result.optimizer_share, '.0%')} of a step), "
                      f"accuracy {_num(result.accuracy, '.4f')}"
                      + (f", compile {result.compile_s:.1f} s (excluded)" if result.compile_s else "")
                      + (f", fused step: {result.fused_step()}" if result.fuse else ""), flush=True)
            else:
                print(f"  -> {result.status}: {result.reason}", flush=True)

    if "hf" in frontends:
        from .hf_frontend import HFPlan, run_hf

        plan = HFPlan(preset, train, valid, out_dir, seed=args.seed, model_dir=args.model, tokenizer=tokenizer,
                      num_labels=num_labels, precision=args.precision, bagua_algorithm=args.bagua_algorithm,
                      bagua_algorithm_args=algorithm_args, progress=not args.no_progress)
        run_hf(plan, rows, on_result=on_result)
    if "fsdp" in frontends:
        from .fsdp_frontend import run_fsdp
        from .hf_frontend import HFPlan

        if args.bagua_algorithm:
            raise SystemExit("error: Bagua algorithms communicate as DDP hooks; under FSDP2 FSDP2 communicates: "
                             "drop --bagua-algorithm with --fsdp")
        if args.precision != "fp32":
            raise SystemExit("error: the fsdp front end runs fp32 (FSDP2's mixed precision is not wired into the recipe)")
        plan = HFPlan(preset, train, valid, out_dir, seed=args.seed, model_dir=args.model, tokenizer=tokenizer,
                      num_labels=num_labels, progress=False)
        run_fsdp(plan, rows, on_result=on_result)
    if "fairseq" in frontends and rank == 0:
        from .fairseq_frontend import FairseqPlan, run_fairseq

        if args.model is not None:
            for row in rows:
                on_result(RowResult("fairseq", row.key, row.label, status="skipped",
                                    reason="--model is an HF checkpoint; the fairseq front end trains roberta from config"))
        else:
            if tokenizer is None:  # pragma: no cover - only with --model
                raise AssertionError("fairseq needs the word tokenizer")
            plan = FairseqPlan(preset, train, valid, tokenizer, out_dir, seed=args.seed, num_labels=num_labels,
                               nproc=args.nproc or world, precision=args.precision,
                               bagua_algorithm=args.bagua_algorithm, bagua_algorithm_args=algorithm_args,
                               threads=args.threads,
                               progress=not args.no_progress, timeout=args.fairseq_timeout)
            run_fairseq(plan, rows, on_result=on_result)
    if rank != 0:
        return 0

    hw_end = hardware()
    add_speedups(results)
    notes = run_notes(args, preset, world, hw, hw_end, data_description, rows)
    fairseq_nproc = args.nproc or world
    if "fairseq" in frontends and fairseq_nproc > 1:
        notes.append(
            f"fairseq rows: {fairseq_nproc} processes (torchrun, --ddp-backend legacy_ddp for every row)"
            + (f", Bagua algorithm {args.bagua_algorithm} on the bagua_fused rows" if args.bagua_algorithm else "")
            + "; times are rank 0's."
        )
    if "fsdp" in frontends:
        from .fsdp_frontend import fsdp_notes

        notes.append(fsdp_notes(world))
    table = markdown_table(results, title, hw, notes)
    with open(os.path.join(out_dir, "results.md"), "w") as handle:
        handle.write(table)
    final = payload(final=True)
    final["notes"] = notes
    final["load_average_1m_end"] = hw_end.get("load_average_1m")
    write_json(os.path.join(out_dir, "results.json"), final)
    png_problem = write_png(os.path.join(out_dir, "epoch_time.png"), results, title, describe_hardware(hw))
    print()
    print(table)
    print(f"Wrote {os.path.join(out_dir, 'results.md')}, {os.path.join(out_dir, 'results.json')}"
          + ("" if png_problem else f", {os.path.join(out_dir, 'epoch_time.png')}"))
    if png_problem:
        print(png_problem, file=sys.stderr)
    failed = [r for r in results if r.status == "failed"]
    return 1 if failed else 0


def run_notes(args, preset: Preset, world: int, hw, hw_end, data_description: str, rows=()) -> List[str]:
    steps = math.ceil(math.ceil(preset.train_size / world) / preset.batch_size) if args.train_file is None else None
    total = max(1, math.ceil(steps * preset.epochs)) if steps else None
    seed_rows = [r.key for r in rows if r.bertadam_defaults]
    frontend_rows = [r.key for r in rows if r.frontend_clips]
    unclipped_rows = [r.key for r in rows if r.frontend_clips_and_schedules and not r.frontend_clips]
    notes = [
        "Epoch time: wall time of one training epoch (data loading, forward, backward, gradient clipping, "
        "optimizer step), without evaluation and without the compile time of compiled rows (its own column).",
        "Optimizer step: mean time of optimizer.step() per update (the fused rows include flattening bookkeeping; "
        "BertAdam's per-parameter clipping happens inside it); its share is that time over the mean update time "
        "(epoch time / updates).",
        "Final accuracy: validation accuracy after the last epoch. Speedup: baseline epoch time / row epoch time, "
        "within each front end (baseline: BertAdam per-tensor with its defaults, Bagua's 'w/o fused optimizer'; "
        "for the bertadam-globalclip* rows: bertadam-globalclip, when it ran).",
        "Median update: the median wall time of one update (all of it: data, forward, backward, clipping, step); "
        "bursts of other jobs on a shared machine move the epoch time much more than this median.",
        "Fused step (ran): what the fused optimizer reported after training, fusion_report(optimizer).group_paths "
        "(per parameter group: 'segmented' = flat buffers with BertAdam's whole-parameter reductions, its "
        "per-parameter clipping, computed per parameter; 'elementwise' = flat buffers, no such reductions; "
        "'per-tensor' = the group's unfused step) and whether the last fused step ran compiled.",
    ]
    if seed_rows:
        notes.append(
            f"Rows {', '.join(seed_rows)}: BertAdam as Bagua's benchmark ran it, BertAdam(groups, lr={preset.lr}, "
            f"warmup={preset.warmup_ratio:g}, t_total={total if total else 'updates'}) with every other argument at "
            "its default: max_grad_norm=1.0 clips each parameter's gradient to norm 1.0, schedule='warmup_linear'. "
            "The front end neither clips nor schedules for these rows (HF: max_grad_norm=0, constant scheduler; "
            "fairseq: --clip-norm 0, --lr-scheduler fixed); both still measure the global gradient norm for "
            "their logs."
        )
    if frontend_rows:
        notes.append(
            f"Rows {', '.join(frontend_rows)}: the front end clips the global gradient norm to "
            f"{float(preset.max_grad_norm)} and schedules the learning rate (lr {preset.lr}, linear warmup "
            f"{preset.warmup_ratio:.0%}, linear decay); BertAdam there runs with max_grad_norm=-1, t_total=-1."
        )
    if unclipped_rows:
        notes.append(
            f"Rows {', '.join(unclipped_rows)}: QAdam (warm-up: the front end's warmup updates); the front end schedules "
            f"the learning rate as for the other rows but does not clip (under --bagua-algorithm qadam the optimizer "
            "receives averaged momentum where gradients were after the warm-up)."
        )
    notes += [
        "Rows ran back to back in this one run, with the same data and seed; HF rows in one process, each "
        "fairseq row in its own fairseq-train process.",
        f"Preset '{preset.name}': BERT with layers={preset.layers}, hidden={preset.hidden}, heads={preset.heads}, FFN "
        f"{preset.intermediate}, vocabulary {preset.vocab_size}, {preset.max_seq_len} tokens, batch {preset.batch_size}"
        f" per device{f', {steps} updates per epoch' if steps else ''}, {preset.epochs:g} epoch(s), {args.precision}.",
        f"Data: {data_description}.",
    ]
    cores = hw.get("cpu_cores") or 1
    start, end = hw.get("load_average_1m"), hw_end.get("load_average_1m")
    if start is not None and end is not None:
        busy = max(start, end) > 0.75 * cores
        notes.append(
            f"1-minute load average {start} at the start and {end} at the end on {cores} cores"
            + (": the machine was shared with other jobs, so timings are noisy." if busy else ".")
        )
    if world > 1:
        settings = f" {args.bagua_algorithm_args}" if args.bagua_algorithm_args else ""
        notes.append(f"{world} processes" + (f", Bagua algorithm {args.bagua_algorithm}{settings}" if args.bagua_algorithm
                                              else ", plain DDP allreduce") + "; times are rank 0's.")
    return notes


if __name__ == "__main__":
    sys.exit(main())
