"""Tests of the BERT benchmark recipe (recipes/bert_benchmark).

The smoke tests run ``python -m recipes.bert_benchmark`` on the ``tiny`` preset in a subprocess
(one torch thread: the machine may be shared) and check its three outputs and that training
beats chance on the generated data. Everything else here is fast and trains nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from _dist_utils import free_port, fsdp2_runs_on_cpu
from recipes.bert_benchmark import DEFAULT_ROWS, ROWS, get_preset, parse_rows
from recipes.bert_benchmark.data import (
    Example,
    SyntheticSpec,
    WordTokenizer,
    generate_split,
    make_vocabulary,
    read_tsv,
    write_tsv,
)
from recipes.bert_benchmark.report import add_speedups, markdown_table, write_png
from recipes.bert_benchmark.results import RowResult, hardware

REPO = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT = 300
CHANCE = 0.5
# 256 validation sentences: 0.6 is more than three standard deviations above chance.
ABOVE_CHANCE = 0.6


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_recipe(*args, timeout=SMOKE_TIMEOUT, launcher=()):
    cmd = [*launcher] if launcher else [sys.executable]
    cmd += ["-m", "recipes.bert_benchmark", "--threads", "1", "--no-progress", *map(str, args)]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the recipe did not finish in {timeout} s: {' '.join(cmd)}\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, f"{' '.join(cmd)} exited with {done.returncode}\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
    return done


def load_outputs(out_dir: Path):
    results = json.loads((out_dir / "results.json").read_text())
    table = (out_dir / "results.md").read_text()
    png = (out_dir / "epoch_time.png").read_bytes()
    return results, table, png


def fairseq_ready() -> bool:
    """fairseq installed (installed but broken fails the fairseq tests instead of skipping them)."""
    return importlib.util.find_spec("fairseq") is not None


requires_fairseq = pytest.mark.skipif(not fairseq_ready(), reason="fairseq is not installed")


# ------------------------------------------------------------------------------------ smoke tests
def test_smoke_hf_tiny_table_json_png_and_learning(tmp_path):
    """The default rows on the tiny preset: table on stdout, JSON, PNG; every row trains above chance."""
    out = tmp_path / "out"
    done = run_recipe("--preset", "tiny", "--out-dir", out)
    results, table, png = load_outputs(out)

    assert "| front end | optimizer | clipping; schedule | fused step (ran) | epoch time (s) |" in done.stdout
    assert table.strip() in done.stdout.replace("\r", "")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000

    assert results["complete"] is True
    rows = results["rows"]
    assert [r["row"] for r in rows] == list(DEFAULT_ROWS)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["frontend"] == "hf"
        assert r["label"] in table
        assert r["epoch_time_s"] > 0 and r["steps"] == 64  # 2 epochs x 1024 / 32
        assert 0 < r["optimizer_share"] < 1
        assert 0 < r["median_optimizer_ms"] < r["median_update_ms"]
        assert r["accuracy"] > ABOVE_CHANCE, f"{r['row']} did not learn: accuracy {r['accuracy']}"
    by_key = {r["row"]: r for r in rows}
    # the seed's rows: BertAdam with its defaults (per-parameter clipping, its own schedule); AdamW: the front end's
    for key in ("bertadam", "bertadam-fused-eager", "bertadam-fused-compiled"):
        assert by_key[key]["clipping"].startswith("per-parameter 1.0"), by_key[key]
        assert by_key[key]["schedule"] == "BertAdam warmup_linear (warmup 0.1, t_total 64)"
    for key in ("adamw-foreach", "adamw-fused"):
        assert by_key[key]["clipping"].startswith("global 1.0") and by_key[key]["schedule"].startswith("front end")
    assert by_key["bertadam"]["fused"] is None and by_key["bertadam"]["group_paths"] is None
    eager = by_key["bertadam-fused-eager"]
    # per-parameter clipping goes through the exact segmented path (both of Trainer's parameter groups)
    assert eager["compiled"] is False and eager["group_paths"] == ["segmented", "segmented"]
    assert eager["fused"].split(" / ")[0] == "25"  # every tensor of the tiny BERT through flat buffers
    assert "| BertAdam fused, eager | per-parameter 1.0; BertAdam | segmented, eager |" in table
    compiled = by_key["bertadam-fused-compiled"]
    assert compiled["fuse"] == "compiled" and compiled["group_paths"] == ["segmented", "segmented"]
    # the table says what ran: compiled (on some or all updates), or eager and why
    line = next(l for l in table.splitlines() if "| BertAdam fused, compile=True" in l)
    assert ("segmented, compiled" in line) if compiled["compiled"] else ("ran eager:" in line or "compiled on" in line)
    # per-tensor and fused BertAdam are the same update: same final accuracy on the same data and seed
    assert by_key["bertadam"]["accuracy"] == by_key["bertadam-fused-eager"]["accuracy"]
    assert by_key["bertadam"]["extra"]["speedup"] == 1.0
    for path in ("data/train.tsv", "data/valid.tsv"):
        assert (out / path).exists()


@pytest.mark.slow  # about 30 s on two idle cores (fairseq-preprocess + 2 fairseq-train subprocesses), 60 s shared
@requires_fairseq
def test_smoke_fairseq_tiny(tmp_path):
    """fairseq front end: fairseq-preprocess + fairseq-train with the recipe's user dir, BertAdam with its
    defaults per-tensor and fused: BertAdam clips per parameter and schedules, fairseq does neither."""
    out = tmp_path / "out"
    done = run_recipe("--preset", "tiny", "--frontend", "fairseq", "--rows", "bertadam,bertadam-fused-eager",
                      "--out-dir", out)
    results, table, png = load_outputs(out)
    assert "| fairseq |" in done.stdout and png.startswith(b"\x89PNG")
    plain, fused = results["rows"]
    for r in (plain, fused):
        assert r["status"] == "ok", r
        assert r["steps"] == 64 and r["epoch_time_s"] > 0 and 0 < r["optimizer_share"] < 1
        assert 0 < r["median_optimizer_ms"] < r["median_update_ms"]
        assert r["accuracy"] > ABOVE_CHANCE, r
        command = r["extra"]["command"]
        assert "--clip-norm 0 " in command and "--lr-scheduler fixed" in command and "polynomial" not in command
        assert "--bert-adam-max-grad-norm 1.0" in command and "--bert-adam-t-total 64" in command
    assert "--optimizer bagua_fused --bagua-base-optimizer bert_adam" in fused["extra"]["command"]
    # the task's own line after a steady fused step: every tensor through the segmented path
    assert fused["group_paths"] == ["segmented"] and fused["fused"].split(" / ")[0] not in ("0", "")
    assert fused["compiled"] is False and "| segmented, eager |" in table
    assert plain["accuracy"] == fused["accuracy"]  # the same update, exactly
    assert (out / "fairseq" / "data-bin" / "input0" / "dict.txt").exists()


def test_smoke_real_tsv_and_local_checkpoint(tmp_path):
    """--train-file/--valid-file (GLUE-style TSV) with --model (a local HF checkpoint: config, weights, tokenizer)."""
    import inspect

    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    spec = SyntheticSpec(vocab_words=300, polar_words=8, min_words=4, max_words=10)
    write_tsv(str(tmp_path / "train.tsv"), generate_split(spec, 512, seed=5))
    write_tsv(str(tmp_path / "dev.tsv"), generate_split(spec, 256, seed=6))
    fillers, positive, negative = make_vocabulary(spec)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + positive + negative + fillers) + "\n")
    checkpoint = tmp_path / "checkpoint"
    # transformers 5 takes the vocabulary as vocab=, 4.x as vocab_file=
    takes_vocab = "vocab" in inspect.signature(BertTokenizerFast.__init__).parameters
    tokenizer = BertTokenizerFast(**{"vocab" if takes_vocab else "vocab_file": str(vocab)})
    assert len(tokenizer) == 5 + 300
    tokenizer.save_pretrained(checkpoint)
    config = BertConfig(vocab_size=310, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(checkpoint)

    out = tmp_path / "out"
    # in this process (the other smoke tests already run the command line), on one thread like them
    import torch

    from recipes.bert_benchmark.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["--preset", "tiny", "--train-file", str(tmp_path / "train.tsv"), "--valid-file",
                     str(tmp_path / "dev.tsv"), "--model", str(checkpoint), "--rows", "bertadam-fused-eager",
                     "--epochs", "3", "--out-dir", str(out), "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    results, table, _ = load_outputs(out)
    (row,) = results["rows"]
    assert row["status"] == "ok" and row["steps"] == 48
    assert row["accuracy"] > ABOVE_CHANCE
    assert str(checkpoint) in results["model"] and "train.tsv" in results["data"]
    assert not (out / "data").exists()  # given data is not copied


# ------------------------------------------------------------------------------------ slow: everything
@pytest.mark.slow
@requires_fairseq
def test_full_tiny_table_both_frontends(tmp_path):
    out = tmp_path / "out"
    run_recipe("--preset", "tiny", "--frontend", "both", "--rows", "all", "--out-dir", out, timeout=900)
    results, table, _ = load_outputs(out)
    rows = results["rows"]
    assert len(rows) == 2 * len(ROWS)
    for r in rows:
        if r["frontend"] == "fairseq" and r["status"] == "skipped":  # a fairseq_plugin without --bagua-compile
            assert r["row"].endswith("fused-eager") and "compile" in r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["accuracy"] > ABOVE_CHANCE, r
    for frontend in ("hf", "fairseq"):
        by_key = {r["row"]: r for r in rows if r["frontend"] == frontend}
        # the front end's clipping + schedule rows: elementwise, compiled, measured against their own baseline
        assert by_key["bertadam-globalclip-fused-compiled"]["group_paths"] in (["elementwise"] * 2, ["elementwise"])
        assert by_key["bertadam-globalclip-fused-compiled"]["extra"]["baseline"] == "bertadam-globalclip"
        assert by_key["bertadam-globalclip"]["accuracy"] == by_key["bertadam-globalclip-fused-eager"]["accuracy"]
        assert by_key["bertadam-fused-eager"]["extra"]["baseline"] == "bertadam"


@pytest.mark.slow
def test_torchrun_two_processes_with_bagua_algorithm(tmp_path):
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    frontend = "both" if fairseq_ready() else "hf"
    done = run_recipe("--preset", "tiny", "--frontend", frontend, "--rows", "bertadam,bertadam-fused-compiled",
                      "--bagua-algorithm", "gradient_allreduce", "--out-dir", out, launcher=launcher, timeout=600)
    results, table, _ = load_outputs(out)
    assert results["world_size"] == 2 and results["bagua_algorithm"] == "gradient_allreduce"
    assert len(results["rows"]) == (4 if frontend == "both" else 2)
    for r in results["rows"]:
        assert r["status"] == "ok", r
        assert r["steps"] == 32  # 1024 sentences / (2 processes x 32) x 2 epochs
        assert r["accuracy"] > ABOVE_CHANCE, r
    if frontend == "both":  # fused + gradient_allreduce trains like unfused + DDP allreduce (up to kernel rounding)
        fairseq = {r["row"]: r for r in results["rows"] if r["frontend"] == "fairseq"}
        assert abs(fairseq["bertadam"]["accuracy"] - fairseq["bertadam-fused-compiled"]["accuracy"]) <= 0.03
        assert "--bagua-algorithm gradient_allreduce" in fairseq["bertadam-fused-compiled"]["extra"]["command"]
    assert "2 processes" in table, done.stdout


@pytest.mark.skipif(not fsdp2_runs_on_cpu(), reason="FSDP2 does not run on CPU with this torch")
def test_fsdp_rows_under_torchrun(tmp_path):
    """The FSDP2 rows (--fsdp): BertAdam with its per-parameter clipping, unfused on DTensors and fused on
    each rank's shards, train to the same accuracy on 2 processes."""
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    done = run_recipe("--preset", "tiny", "--fsdp", "--rows", "bertadam,bertadam-fused-eager", "--out-dir", out,
                      launcher=launcher, timeout=600)
    results, table, _ = load_outputs(out)
    assert results["world_size"] == 2 and results["frontends"] == ["fsdp"]
    rows = {r["row"]: r for r in results["rows"]}
    for r in rows.values():
        assert r["status"] == "ok" and r["frontend"] == "fsdp", r
        assert r["steps"] == 32 and r["accuracy"] > ABOVE_CHANCE, r
    assert rows["bertadam-fused-eager"]["group_paths"] == ["segmented", "segmented"]
    assert rows["bertadam-fused-eager"]["accuracy"] == rows["bertadam"]["accuracy"]
    assert "FSDP2 loop" in table and "fully_shard" in table, done.stdout


# ------------------------------------------------------------------------------------ fast unit tests
def test_generated_data_is_deterministic_balanced_and_well_formed():
    spec = SyntheticSpec(vocab_words=500, polar_words=10, min_words=5, max_words=9, label_noise=0.0)
    a, b = generate_split(spec, 200, seed=3), generate_split(spec, 200, seed=3)
    assert a == b
    assert generate_split(spec, 200, seed=4) != a
    assert sum(e.label for e in a) == 100
    fillers, positive, negative = make_vocabulary(spec)
    assert len(set(fillers + positive + negative)) == 500
    for example in a:
        words = example.sentence.split()
        pos, neg = sum(w in positive for w in words), sum(w in negative for w in words)
        assert pos != neg and example.label == int(pos > neg)  # no label noise: the rule holds exactly
        assert all(w in fillers or w in positive or w in negative for w in words)


def test_tsv_round_trip_and_glue_layouts(tmp_path):
    examples = [Example("a fine film .", 1), Example("dull , slow", 0)]
    path = tmp_path / "train.tsv"
    write_tsv(str(path), examples)
    assert path.read_text().splitlines()[0] == "sentence\tlabel"
    assert read_tsv(str(path)) == examples
    # SST-2's layout with an extra column, and a file without a header
    (tmp_path / "x.tsv").write_text("idx\tsentence\tlabel\n0\tgood\t1\n1\tbad\t0\n")
    assert read_tsv(str(tmp_path / "x.tsv")) == [Example("good", 1), Example("bad", 0)]
    (tmp_path / "y.tsv").write_text("good\t1\nbad\t0\n")
    assert read_tsv(str(tmp_path / "y.tsv")) == [Example("good", 1), Example("bad", 0)]
    (tmp_path / "z.tsv").write_text("sentence\tlabel\ngood\tpositive\n")
    with pytest.raises(ValueError, match="line 2"):
        read_tsv(str(tmp_path / "z.tsv"))


def test_word_tokenizer():
    tokenizer = WordTokenizer(["good", "film"])
    ids, mask = tokenizer.encode("Good film, really!", max_length=8)
    assert ids == [tokenizer.cls_id, 4, 5, tokenizer.unk_id, tokenizer.unk_id, tokenizer.unk_id, tokenizer.sep_id, 0]
    assert mask == [1, 1, 1, 1, 1, 1, 1, 0]
    ids, mask = tokenizer.encode("good " * 20, max_length=5)
    assert ids == [tokenizer.cls_id, 4, 4, 4, tokenizer.sep_id] and mask == [1] * 5
    frequent = WordTokenizer.from_examples([Example("b a a", 0), Example("c a b", 1)], max_words=2)
    assert frequent.itos[4:] == ["a", "b"]


def test_presets_and_rows():
    cpu = get_preset("cpu")
    assert cpu.vocab_size == 30522  # BERT's embedding: what makes the optimizer step visible on a CPU
    assert get_preset("bert-base").hidden == 768 and get_preset("bert-base").layers == 12
    assert cpu.with_overrides(epochs=0.5, lr=None).epochs == 0.5 and cpu.with_overrides(lr=None).lr == cpu.lr
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("huge")
    assert [r.key for r in parse_rows(None)] == list(DEFAULT_ROWS)
    assert [r.key for r in parse_rows("all")] == list(ROWS)
    assert [r.key for r in parse_rows("adamw-fused, bertadam")] == ["adamw-fused", "bertadam"]
    assert [r.key for r in parse_rows("default,bertadam-globalclip")] == list(DEFAULT_ROWS) + ["bertadam-globalclip"]
    # the default table is the seed's experiment: BertAdam with its defaults, without / with the fused optimizer
    assert [k for k in DEFAULT_ROWS if k.startswith("bertadam")] == [
        "bertadam", "bertadam-fused-eager", "bertadam-fused-compiled"]
    assert all(ROWS[k].bertadam_defaults and not ROWS[k].frontend_clips_and_schedules
               for k in DEFAULT_ROWS if k.startswith("bertadam"))
    # the recipe's earlier configuration stays as extra rows
    for key, fuse in (("bertadam-globalclip", None), ("bertadam-globalclip-fused-eager", "eager"),
                      ("bertadam-globalclip-fused-compiled", "compiled")):
        assert key in ROWS and key not in DEFAULT_ROWS
        row = ROWS[key]
        assert row.optimizer == "bertadam" and row.fuse == fuse and row.frontend_clips_and_schedules
        assert row.baseline == "bertadam-globalclip"
    assert ROWS["adamw-fused"].frontend_clips_and_schedules and ROWS["adamw-fused"].baseline == "bertadam"
    with pytest.raises(ValueError, match="BertAdam setting"):
        type(ROWS["adamw-fused"])("x", "x", "adamw", bertadam_defaults=True)
    with pytest.raises(ValueError, match="unknown row"):
        parse_rows("bertadam,lamb")
    with pytest.raises(ValueError, match="twice"):
        parse_rows("bertadam,bertadam")
    assert ROWS["bertadam-fused-compiled"].compile is True and ROWS["bertadam-fused-eager"].compile is False
    assert ROWS["bertadam"].compile is None


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32))


def test_hf_optimizers_per_row():
    import torch
    from transformers import TrainingArguments

    from bagua_integrations import fusion_report, is_fused_optimizer
    from bagua_integrations.optim import BertAdam
    from recipes.bert_benchmark.hf_frontend import build_optimizer

    model = _tiny_bert()
    args = TrainingArguments(output_dir="unused", learning_rate=1e-3, weight_decay=0.01, report_to="none", use_cpu=True)
    schedule = dict(total_steps=40, warmup_ratio=0.1)
    # the seed's rows: BertAdam(groups, lr, warmup, t_total), everything else at BertAdam's defaults
    base = build_optimizer(ROWS["bertadam"], model, args, **schedule)
    assert type(base) is BertAdam and not is_fused_optimizer(base)
    defaults = BertAdam([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert defaults["max_grad_norm"] == 1.0 and defaults["schedule"] == "warmup_linear"
    expected = dict(defaults, lr=1e-3, warmup=0.1, t_total=40)
    expected.pop("weight_decay")  # per group: Trainer's decay / no-decay split
    for group in base.param_groups:
        assert {k: group[k] for k in expected} == expected
    assert [g["weight_decay"] for g in base.param_groups] == [0.01, 0.0]
    for key in ("bertadam-fused-eager", "bertadam-fused-compiled"):
        fused = build_optimizer(ROWS[key], _tiny_bert(), args, **schedule)
        assert is_fused_optimizer(fused) and fused.defaults["max_grad_norm"] == 1.0
        assert fused.defaults["t_total"] == 40 and fused.defaults["warmup"] == 0.1
        # per-parameter clipping: fused exactly through the segmented path, every tensor in flat buffers
        report = fusion_report(fused)
        assert report.group_paths == ["segmented", "segmented"] and report.unfused_params == 0
    with pytest.raises(ValueError, match="t_total"):
        build_optimizer(ROWS["bertadam"], model, args)
    # the extra rows: Trainer clips globally and schedules, BertAdam is elementwise
    plain = build_optimizer(ROWS["bertadam-globalclip"], model, args, **schedule)
    assert plain.defaults["max_grad_norm"] < 0 and plain.defaults["t_total"] == -1
    eager = build_optimizer(ROWS["bertadam-globalclip-fused-eager"], _tiny_bert(), args)
    report = fusion_report(eager)
    assert report.compiled is False and report.group_paths == ["elementwise", "elementwise"]
    fused = build_optimizer(ROWS["adamw-fused"], model, args)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True


def _scheduler(args) -> str:
    return getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)  # an enum in TrainingArguments


def test_hf_front_end_neither_clips_nor_schedules_for_bertadam_defaults(tmp_path):
    """BertAdam with its defaults clips and schedules itself; Trainer must do neither (no double clipping or
    scheduling). The rows where Trainer clips and schedules still get both."""
    import torch
    from transformers import Trainer, TrainerCallback

    from recipes.bert_benchmark.cli import load_data
    from recipes.bert_benchmark.hf_frontend import HFPlan, build_optimizer

    # a global clip far below the gradients' norm: any clipping by Trainer would show in every update
    preset = get_preset("tiny").with_overrides(train_size=192, valid_size=32, epochs=1, max_grad_norm=1e-3)
    options = types.SimpleNamespace(train_file=None, valid_file=None, model=None, seed=0)
    train, valid, tokenizer, _ = load_data(options, preset)
    plan = HFPlan(preset, train, valid, str(tmp_path), tokenizer=tokenizer, progress=False)
    total = plan.total_steps()
    assert total == 6

    class Spy(TrainerCallback):
        """Gradients as backward left them and as the optimizer sees them; the group lr per update."""

        def __init__(self, model, optimizer):
            self.optimizer, self.lrs, self.clipped = optimizer, [], []
            self.raw = {}
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: self.raw.__setitem__(p, p.grad.clone()))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.lrs.append([g["lr"] for g in self.optimizer.param_groups])
            assert self.raw
            self.clipped.append(any(p.grad is None or not torch.equal(p.grad, g) for p, g in self.raw.items()))
            self.raw.clear()

    def train(key):
        row = ROWS[key]
        args = plan.training_args(row, disable_tqdm=True)
        model = plan.build_model()
        optimizer = build_optimizer(row, model, args, total_steps=total, warmup_ratio=preset.warmup_ratio)
        spy = Spy(model, optimizer)
        Trainer(model=model, args=args, train_dataset=plan.datasets()[0], optimizers=(optimizer, None),
                callbacks=[spy]).train()
        return args, optimizer, spy

    args, optimizer, spy = train("bertadam")
    assert args.max_grad_norm == 0 and _scheduler(args) == "constant" and args.warmup_steps == 0
    assert spy.lrs == [[preset.lr, preset.lr]] * total  # Trainer leaves the lr alone ...
    assert not any(spy.clipped)  # ... and the gradients too
    steps = [optimizer.state[p]["step"] for p in optimizer.param_groups[0]["params"] if optimizer.state[p]]
    assert set(steps) == {total}  # BertAdam scheduled itself over t_total = every update

    args, _, spy = train("bertadam-globalclip")
    assert args.max_grad_norm == preset.max_grad_norm and _scheduler(args) == "linear"
    assert len({lrs[0] for lrs in spy.lrs}) > 2  # Trainer's warmup + decay
    assert all(spy.clipped)  # and its global clip (the spy sees it)


def test_fairseq_optimizer_flags():
    from recipes.bert_benchmark.data import WordTokenizer
    from recipes.bert_benchmark.fairseq_frontend import FairseqPlan, optimizer_args

    preset = get_preset("tiny")
    base = optimizer_args(ROWS["bertadam"], preset, None, 64)
    assert base[:2] == ["--optimizer", "bert_adam"]
    flags = dict(zip(base[2::2], base[3::2]))
    assert flags["--bert-adam-max-grad-norm"] == "1.0" and flags["--bert-adam-t-total"] == "64"
    assert flags["--bert-adam-warmup"] == "0.1" and flags["--bert-adam-schedule"] == "warmup_linear"
    with pytest.raises(ValueError, match="t_total"):
        optimizer_args(ROWS["bertadam"], preset, None)
    fused = optimizer_args(ROWS["bertadam-fused-compiled"], preset, None, 64)
    assert fused[:4] == ["--optimizer", "bagua_fused", "--bagua-base-optimizer", "bert_adam"]
    assert "--bert-adam-eps" in fused and "--bert-adam-max-grad-norm" in fused
    with pytest.raises(ValueError, match="eager"):
        optimizer_args(ROWS["bertadam-fused-eager"], preset, None, 64)
    eager = optimizer_args(ROWS["bertadam-fused-eager"], preset, "--bagua-compile", 64)
    assert eager[eager.index("--bagua-compile") + 1] == "false"
    globalclip = optimizer_args(ROWS["bertadam-globalclip-fused-compiled"], preset, "--bagua-compile")
    assert globalclip[globalclip.index("--bert-adam-max-grad-norm") + 1] == "-1"
    assert globalclip[globalclip.index("--bert-adam-t-total") + 1] == "-1"
    adamw = optimizer_args(ROWS["adamw-fused"], preset, None)
    assert adamw[:4] == ["--optimizer", "torch_adamw", "--torch-adamw-impl", "fused"]

    # who clips and schedules: BertAdam with its defaults, or fairseq
    plan = FairseqPlan(preset, [], [], WordTokenizer(["a"]), "unused")
    plan.train_examples = [None] * 1024  # 32 updates per epoch, 2 epochs
    seed = plan.command(ROWS["bertadam-fused-eager"], "--bagua-compile")
    assert seed[seed.index("--clip-norm") + 1] == "0" and seed[seed.index("--lr-scheduler") + 1] == "fixed"
    assert "--total-num-update" not in seed and "--warmup-updates" not in seed
    assert seed[seed.index("--save-dir") + 1].startswith(plan.out_dir)  # not ./checkpoints
    assert seed[seed.index("--bert-adam-t-total") + 1] == "64"
    other = plan.command(ROWS["bertadam-globalclip"], "--bagua-compile")
    assert other[other.index("--clip-norm") + 1] == "1.0"
    assert other[other.index("--lr-scheduler") + 1] == "polynomial_decay"
    assert other[other.index("--warmup-updates") + 1] == "6" and other[other.index("--total-num-update") + 1] == "64"


def test_report_table_speedups_and_png(tmp_path):
    seed = dict(clipping=ROWS["bertadam"].clipping(1.0), schedule=ROWS["bertadam"].schedule(0.1, 100))
    front = dict(clipping=ROWS["adamw-fused"].clipping(1.0), schedule=ROWS["adamw-fused"].schedule(0.1, 100))
    rows = [
        RowResult("hf", "bertadam", "BertAdam per-tensor", epoch_time_s=10.0, optimizer_step_ms=20.0,
                  optimizer_share=0.5, accuracy=0.9, steps=100, **seed),
        RowResult("hf", "bertadam-fused-compiled", "BertAdam fused, compile=True", epoch_time_s=8.0,
                  optimizer_step_ms=4.0, optimizer_share=0.1, accuracy=0.9, compile_s=3.0, compiled=True, steps=100,
                  median_update_ms=79.0, fuse="compiled", group_paths=["segmented", "segmented"], **seed),
        RowResult("hf", "bertadam-fused-eager", "BertAdam fused, eager", epoch_time_s=9.0, fuse="eager",
                  compiled=False, group_paths=["segmented", "segmented"], **seed),
        RowResult("hf", "bertadam-globalclip", "BertAdam per-tensor, front-end clip+schedule", epoch_time_s=6.0,
                  **front),
        RowResult("hf", "bertadam-globalclip-fused-compiled", "BertAdam fused, compiled, front-end clip+schedule",
                  epoch_time_s=4.0, fuse="compiled", compiled=True, compiled_share=0.5,
                  group_paths=["elementwise", "elementwise"], **front),
        RowResult("hf", "adamw-fused", "torch AdamW fused=True", epoch_time_s=5.0, **front),
        RowResult("fairseq", "bertadam-fused-eager", "BertAdam fused, eager", status="skipped", reason="no switch"),
        # asked to compile, but the segmented step ran eagerly: the table says so
        RowResult("fairseq", "bertadam-fused-compiled", "BertAdam fused, compile=True", epoch_time_s=2.0,
                  fuse="compiled", compiled=False, compiled_share=0.0, group_paths=["segmented"], **seed),
    ]
    add_speedups(rows)
    assert rows[1].extra["speedup"] == pytest.approx(1.25) and rows[1].extra["time_change"] == pytest.approx(-0.2)
    # the front end's clip + schedule rows against their own per-tensor baseline; AdamW against the seed's
    assert rows[4].extra["baseline"] == "bertadam-globalclip" and rows[4].extra["speedup"] == pytest.approx(1.5)
    assert rows[5].extra["baseline"] == "bertadam" and rows[5].extra["speedup"] == pytest.approx(2.0)
    assert rows[7].extra["baseline"] == "bertadam-fused-compiled"  # the only measured fairseq row
    table = markdown_table(rows, "title", hardware(), notes=["a note"])
    assert ("| HF Trainer | BertAdam fused, compile=True | per-parameter 1.0; BertAdam | segmented, compiled | 8.00 "
            "| 4.0 | 10.0% | 0.9000 | 1.25x (-20.0% time) | 79.0 | 3.0 |") in table
    assert "| HF Trainer | BertAdam fused, eager | per-parameter 1.0; BertAdam | segmented, eager | 9.00 |" in table
    assert "| HF Trainer | BertAdam per-tensor | per-parameter 1.0; BertAdam | - | 10.0 |" in table
    assert ("| global 1.0; front end | elementwise, compiled on 50% of updates | 4.00 | - | -% | - "
            "| 1.50x (-33.3% time) vs bertadam-globalclip |") in table
    assert "| fairseq | BertAdam fused, eager | - | | skipped: no switch |" in table
    assert ("| fairseq | BertAdam fused, compile=True (ran eager: fuse_optimizer ran its segmented groups "
            "(per-parameter clipping) eagerly) | per-parameter 1.0; BertAdam | segmented, eager |") in table
    assert "3252" in table and "- a note" in table
    assert write_png(str(tmp_path / "chart.png"), rows, "title") is None
    assert (tmp_path / "chart.png").read_bytes().startswith(b"\x89PNG")


def test_cli_errors_are_named(capsys):
    from recipes.bert_benchmark.cli import main

    with pytest.raises(SystemExit, match="unknown row"):
        main(["--rows", "nope"])
    with pytest.raises(SystemExit, match="go together"):
        main(["--train-file", "x.tsv"])
    with pytest.raises(SystemExit, match="unknown --bagua-algorithm"):
        main(["--bagua-algorithm", "nope"])


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "argument --batch-size: must be a whole number >= 1, got '0'"),
    (["--batch-size", "x"], "argument --batch-size: must be a whole number >= 1, got 'x'"),
    (["--train-size", "0"], "argument --train-size: must be a whole number >= 1, got '0'"),
    (["--valid-size", "0"], "argument --valid-size: must be a whole number >= 1, got '0'"),
    (["--threads", "0"], "argument --threads: must be a whole number >= 1, got '0'"),
    (["--nproc", "0", "--frontend", "fairseq"], "argument --nproc: must be a whole number >= 1, got '0'"),
    (["--max-seq-len", "1"], "argument --max-seq-len: must be a whole number >= 3 ([CLS], [SEP] and at least one word)"),
    (["--max-seq-len", "2"], "argument --max-seq-len: must be a whole number >= 3"),
    (["--epochs", "0"], "argument --epochs: must be a positive number, got '0'"),
    (["--epochs", "-1"], "argument --epochs: must be a positive number, got '-1'"),
    (["--epochs", "nan"], "argument --epochs: must be a positive number, got 'nan'"),
    (["--lr", "-1"], "argument --lr: must be a positive number, got '-1'"),
    (["--lr", "inf"], "argument --lr: must be a positive number, got 'inf'"),
    (["--fairseq-timeout", "-5"], "argument --fairseq-timeout: must be a positive number, got '-5'"),
    (["--seed", "-5"], "argument --seed: must be a whole number from 0 to 4294967295, got '-5'"),
    (["--seed", str(2**32)], "argument --seed: must be a whole number from 0 to 4294967295"),
    (["--rows", ","], "--rows ',' names no row: name at least one, e.g. --rows default"),
    (["--frontend", "hf", "--fsdp"], "--fsdp (the same as --frontend fsdp) contradicts --frontend hf: pass only one of them"),
    (["--frontend", "both", "--fsdp"], "--fsdp (the same as --frontend fsdp) contradicts --frontend both"),
    (["--model", "/nonexistent"], "--model /nonexistent is not a directory: it must be a local HF checkpoint directory"),
])
def test_cli_refuses_bad_values_before_training(monkeypatch, capsys, args, message):
    """Each is an argparse error (exit status 2, one line naming the flag and what it accepts), never a
    traceback in the middle of training or a table of nonsense (they were, in a QA pass)."""
    from recipes.bert_benchmark import cli

    def no_training(*_args, **_kwargs):
        raise AssertionError(f"{args} was accepted: the recipe went on to load data and train")

    monkeypatch.setattr(cli, "load_data", no_training)
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m recipes.bert_benchmark: error: {message}" in err, err


def test_cli_accepts_the_documented_command_lines(tmp_path):
    """The command lines of docs/recipes.md, scripts/gpu_checklist.sh and these tests still parse."""
    from recipes.bert_benchmark.cli import parse_args

    checkpoint = tmp_path / "bert-base-uncased"
    checkpoint.mkdir()
    for argv, frontend in [
        ([], "hf"),
        (["--frontend", "both"], "both"),
        (["--threads", "1", "--no-progress", "--out-dir", str(tmp_path)], "hf"),
        (["--preset", "bert-base", "--frontend", "both", "--epochs", "0.2"], "both"),
        (["--preset", "bert-base", "--epochs", "0.05", "--precision", "bf16"], "hf"),
        (["--train-file", "train.tsv", "--valid-file", "dev.tsv", "--model", str(checkpoint)], "hf"),
        (["--fsdp", "--rows", "bertadam,bertadam-fused-eager"], "fsdp"),
        (["--frontend", "fsdp", "--fsdp"], "fsdp"),
        (["--rows", "qadam-fused-eager", "--bagua-algorithm", "qadam"], "hf"),
        (["--bagua-algorithm", "async", "--bagua-algorithm-args", '{"sync_interval_ms": 0}'], "hf"),
        (["--frontend", "fairseq", "--nproc", "2", "--bagua-algorithm", "decentralized"], "fairseq"),
        (["--rows", "default,bertadam-globalclip", "--epochs", "3", "--lr", "1e-4", "--batch-size", "1"], "hf"),
        (["--rows", "", "--seed", str(2**32 - 1), "--max-seq-len", "3", "--train-size", "1", "--valid-size", "1"], "hf"),
    ]:
        assert parse_args(argv).frontend == frontend, argv
