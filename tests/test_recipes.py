"""Tests of the BERT benchmark recipe (recipes/bert_benchmark).

The smoke tests run ``python -m recipes.bert_benchmark`` on the ``tiny`` preset in a subprocess
(one torch thread: the machine may be shared) and check its three outputs and that training
beats chance on the generated data. Everything else here is fast and trains nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _dist_utils import free_port
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
    if shutil.which("fairseq-train") is None or shutil.which("fairseq-preprocess") is None:
        return False
    try:
        import fairseq  # noqa: F401
    except ImportError:
        return False
    return True


requires_fairseq = pytest.mark.skipif(not fairseq_ready(), reason="fairseq (fairseq-train) is not installed")


# ------------------------------------------------------------------------------------ smoke tests
def test_smoke_hf_tiny_table_json_png_and_learning(tmp_path):
    """The default rows on the tiny preset: table on stdout, JSON, PNG; every row trains above chance."""
    out = tmp_path / "out"
    done = run_recipe("--preset", "tiny", "--out-dir", out)
    results, table, png = load_outputs(out)

    assert "| front end | optimizer | epoch time (s) | optimizer step (ms) |" in done.stdout
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
    assert by_key["bertadam"]["fused"] is None
    assert by_key["bertadam-fused-eager"]["compiled"] is False
    compiled = by_key["bertadam-fused-compiled"]
    assert compiled["compiled"] or compiled["extra"].get("compile_disabled_reason")
    # per-tensor and fused BertAdam are the same update: same final accuracy on the same data and seed
    assert by_key["bertadam"]["accuracy"] == by_key["bertadam-fused-eager"]["accuracy"]
    assert by_key["bertadam"]["extra"]["speedup"] == 1.0
    for path in ("data/train.tsv", "data/valid.tsv"):
        assert (out / path).exists()


@pytest.mark.slow  # about 25 s on two idle cores (fairseq-preprocess + fairseq-train subprocesses), 45 s shared
@requires_fairseq
def test_smoke_fairseq_tiny(tmp_path):
    """fairseq front end: fairseq-preprocess + fairseq-train with the recipe's user dir, per-tensor and fused."""
    out = tmp_path / "out"
    done = run_recipe("--preset", "tiny", "--frontend", "fairseq", "--rows", "bertadam-fused-compiled", "--out-dir", out)
    results, table, png = load_outputs(out)
    assert "| fairseq |" in done.stdout and png.startswith(b"\x89PNG")
    (fused,) = results["rows"]
    assert fused["status"] == "ok", fused
    assert fused["steps"] == 64 and fused["epoch_time_s"] > 0 and 0 < fused["optimizer_share"] < 1
    assert 0 < fused["median_optimizer_ms"] < fused["median_update_ms"]
    assert fused["accuracy"] > ABOVE_CHANCE, fused
    assert fused["fused"] and fused["fused"].split(" / ")[0] != "0"  # the plugin's first-step line was parsed
    assert "--optimizer bagua_fused --bagua-base-optimizer bert_adam" in fused["extra"]["command"]
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
            assert r["row"] == "bertadam-fused-eager" and "compile" in r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["accuracy"] > ABOVE_CHANCE, r


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
    with pytest.raises(ValueError, match="unknown row"):
        parse_rows("bertadam,lamb")
    with pytest.raises(ValueError, match="twice"):
        parse_rows("bertadam,bertadam")
    assert ROWS["bertadam-fused-compiled"].compile is True and ROWS["bertadam-fused-eager"].compile is False
    assert ROWS["bertadam"].compile is None


def test_hf_optimizers_per_row():
    import torch
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

    from bagua_integrations import fusion_report, is_fused_optimizer
    from bagua_integrations.optim import BertAdam
    from recipes.bert_benchmark.hf_frontend import build_optimizer

    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    args = TrainingArguments(output_dir="unused", learning_rate=1e-3, weight_decay=0.01, report_to="none", use_cpu=True)
    base = build_optimizer(ROWS["bertadam"], model, args)
    assert type(base) is BertAdam and not is_fused_optimizer(base)
    assert base.defaults["max_grad_norm"] < 0 and base.defaults["t_total"] == -1  # elementwise, Trainer schedules
    assert [g["weight_decay"] for g in base.param_groups] == [0.01, 0.0]
    eager = build_optimizer(ROWS["bertadam-fused-eager"], model, args)
    assert is_fused_optimizer(eager) and fusion_report(eager).compiled is False
    fused = build_optimizer(ROWS["adamw-fused"], model, args)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True


def test_fairseq_optimizer_flags():
    from recipes.bert_benchmark.fairseq_frontend import optimizer_args

    preset = get_preset("tiny")
    assert optimizer_args(ROWS["bertadam"], preset, None)[:2] == ["--optimizer", "bert_adam"]
    fused = optimizer_args(ROWS["bertadam-fused-compiled"], preset, None)
    assert fused[:4] == ["--optimizer", "bagua_fused", "--bagua-base-optimizer", "bert_adam"]
    assert "--bert-adam-eps" in fused
    with pytest.raises(ValueError, match="eager"):
        optimizer_args(ROWS["bertadam-fused-eager"], preset, None)
    eager = optimizer_args(ROWS["bertadam-fused-eager"], preset, "--bagua-compile")
    assert eager[eager.index("--bagua-compile") + 1] == "false"
    adamw = optimizer_args(ROWS["adamw-fused"], preset, None)
    assert adamw[:4] == ["--optimizer", "torch_adamw", "--torch-adamw-impl", "fused"]


def test_report_table_speedups_and_png(tmp_path):
    rows = [
        RowResult("hf", "bertadam", "BertAdam per-tensor", epoch_time_s=10.0, optimizer_step_ms=20.0,
                  optimizer_share=0.5, accuracy=0.9, steps=100),
        RowResult("hf", "bertadam-fused-compiled", "BertAdam fused, compiled", epoch_time_s=8.0,
                  optimizer_step_ms=4.0, optimizer_share=0.1, accuracy=0.9, compile_s=3.0, compiled=True, steps=100,
                  median_update_ms=79.0),
        RowResult("fairseq", "bertadam-fused-eager", "BertAdam fused, eager", status="skipped", reason="no switch"),
    ]
    add_speedups(rows)
    assert rows[1].extra["speedup"] == pytest.approx(1.25) and rows[1].extra["time_change"] == pytest.approx(-0.2)
    table = markdown_table(rows, "title", hardware(), notes=["a note"])
    assert "| HF Trainer | BertAdam fused, compiled | 8.00 | 4.0 | 10.0% | 0.9000 | 1.25x (-20.0% time) | 79.0 | 3.0 |" in table
    assert "| fairseq | BertAdam fused, eager | skipped: no switch |" in table
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
