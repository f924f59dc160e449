"""The command-line contract: JSONL in and out, `check` exit codes (including a broken verifier that must make it
fail, greedy and sampling), --help for every command, and one-line errors for bad input."""
from __future__ import annotations

import json

import pytest
import torch

import eaglex.runtime.batch as batch_mod
from eaglex.cli import build_parser, main
from eaglex.runtime.types import Verdict


@pytest.fixture()
def prompt_file(tmp_path, prompts):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts[:6]))
    return f


def test_help_lists_every_option(capsys):
    for cmd in ("generate", "check"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        for flag in ("--target", "--draft", "--engine", "--method", "--tree", "--threads", "--temperature", "--top-p",
                     "--top-k", "--seed", "--max-new-tokens", "--dtype", "chain:N", "dynamic:TOTAL/DEPTH/TOPK"):
            assert flag in out
        assert "--total-tokens" not in out        # retired: refused with the new spelling (BAD below)


def test_generate_jsonl_contract(models, prompt_file, tmp_path):
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]),
               "--prompts", str(prompt_file), "--max-new-tokens", "12", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    for r, p in zip(rows, prompt_file.read_text().splitlines()):
        assert r["input_ids"] == json.loads(p)["input_ids"]
        assert {"output_ids", "accept_lengths", "cycles", "seconds"} <= set(r)
        assert 1 <= len(r["output_ids"]) <= 12 and len(r["accept_lengths"]) == r["cycles"]


def test_generate_vanilla_prints_ids_and_summary(models, prompt_file, capsys):
    assert main(["generate", "--target", str(models["qwen2"]), "--prompts", str(prompt_file),
                 "--max-new-tokens", "5"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.splitlines()) == 6 and "[vanilla]" in cap.err and "tokens/s" in cap.err


@pytest.mark.parametrize("method,head", [("eagle3", "eagle3"), ("eagle2", "eagle1"), ("eagle1", "eagle1")])
def test_check_passes(method, head, models, prompt_file, capsys):
    rc = main(["check", "--target", str(models["llama"]), "--draft", str(models[f"llama/{head}"]),
               "--method", method, "--prompts", str(prompt_file), "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "6/6 identical" in out


def _accept_first_child(tree, logits, *args):
    """A wrong verifier: follows the first child at every level without looking at the target."""
    nodes = [0]
    while True:
        children = (tree.parents == nodes[-1]).nonzero().flatten()
        if children.numel() == 0:
            break
        nodes.append(int(children[0]))
    return Verdict(torch.tensor(nodes), int(logits[nodes[-1]].argmax()))


def _accept_first_children(trees, logits, *args):
    """The wrong verifier in place of the generator core's (every generator runs it, alone or batched)."""
    return [_accept_first_child(t, row) for t, row in zip(trees, logits)]


def test_check_fails_on_a_broken_verifier(models, prompt_file, capsys, monkeypatch):
    monkeypatch.setattr(batch_mod, "verify_rows", _accept_first_children)
    rc = main(["check", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]),
               "--prompts", str(prompt_file), "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert rc == 1 and "NO" in out and "margin" in out


def test_check_batched(models, prompt_file, capsys, monkeypatch):
    """--batch: each prompt decoded among the others by the batcher must equal it decoded alone; a batcher that
    accepts draft tokens without looking at the target when it verifies several requests at once must fail the
    check."""
    args = ["check", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]),
            "--prompts", str(prompt_file), "--max-new-tokens", "24", "--batch", "4"]
    assert main(args) == 0, capsys.readouterr().out
    assert "6/6 identical to vanilla decoded alone when batched (up to 4 at a time" in capsys.readouterr().out
    verify_rows = batch_mod.verify_rows

    def broken_when_batched(trees, *args):
        return (_accept_first_children if len(trees) > 1 else verify_rows)(trees, *args)
    monkeypatch.setattr(batch_mod, "verify_rows", broken_when_batched)
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "6/6 identical to vanilla (" in out and "batched output differs from vanilla decoded alone" in out


def _check_sampling_args(models, tmp_path, prompts, tree: str) -> list[str]:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts[:2]))
    return ["check", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]), "--prompts", str(f),
            "--temperature", "5", "--samples", "400", "--tree", tree]


def test_check_sampling(models, tmp_path, prompts, capsys, monkeypatch):
    """The fixtures are peaked (median top-1 logit gap ~12), so a high temperature makes the target distribution broad."""
    args = _check_sampling_args(models, tmp_path, prompts, "dynamic:8/4/3")
    assert main(args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "2/2 identical to vanilla (" in out and "2/2 prompts consistent with the target distribution" in out
    monkeypatch.setattr(batch_mod, "verify_rows", _accept_first_children)
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "2/2 identical to vanilla (" not in out


def test_check_sampled_batched(models, prompt_file, capsys, monkeypatch):
    """Sampled, each prompt decoded among the others by the batcher is the one vanilla samples alone with the same
    seed; a batcher that accepts draft tokens blindly when it verifies several requests at once fails."""
    args = ["check", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]),
            "--prompts", str(prompt_file), "--max-new-tokens", "24", "--batch", "4", "--temperature", "1.5",
            "--samples", "0"]
    assert main(args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "6/6 identical to vanilla (" in out and "6/6 identical to vanilla decoded alone when batched" in out
    assert "consistent with the target distribution" not in out                      # --samples 0: skipped
    verify_rows = batch_mod.verify_rows

    def broken_when_batched(trees, *args):
        return (_accept_first_children if len(trees) > 1 else verify_rows)(trees, *args)
    monkeypatch.setattr(batch_mod, "verify_rows", broken_when_batched)
    assert main(args) == 1
    assert "batched output differs from vanilla decoded alone" in capsys.readouterr().out


def test_check_sampling_cost_tree(models, tmp_path, prompts, capsys):
    """A cost tree's size depends on the draft alone, never on the target's draws: sampling stays exact."""
    assert main(_check_sampling_args(models, tmp_path, prompts, "cost:4/3")) == 0, capsys.readouterr().out


def _write(tmp_path, text):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    return str(f)


BAD = [
    (lambda m, t: ["--target", str(t / "nope"), "--prompts", _write(t, '{"input_ids": [1]}\n')], "does not exist"),
    (lambda m, t: ["--target", str(m["llama"]), "--prompts", str(t / "missing.jsonl")], "does not exist"),
    (lambda m, t: ["--target", str(m["llama"]), "--prompts", _write(t, '{"prompt": "hi"}\n')], "needs a tokenizer"),
    (lambda m, t: ["--target", str(m["llama"]), "--prompts", _write(t, "{oops\n")], "not valid JSON"),
    (lambda m, t: ["--target", str(m["llama"]), "--prompts", _write(t, '{"input_ids": [1, 999]}\n')], r"\[0, 48\)"),
    (lambda m, t: ["--target", str(m["llama"]), "--prompts", _write(t, '{"input_ids": []}\n')], "empty"),
    (lambda m, t: ["--target", str(m["llama"]), "--draft", str(m["llama/eagle3"]), "--method", "eagle2",
                   "--prompts", _write(t, '{"input_ids": [1]}\n')], "use method eagle3"),
    (lambda m, t: ["--target", str(m["llama"]), "--method", "eagle3",
                   "--prompts", _write(t, '{"input_ids": [1]}\n')], "needs a draft head"),
    (lambda m, t: ["--target", str(m["llama"]), "--draft", str(m["llama/eagle3"]), "--tree", "dynamic:1/3/3",
                   "--prompts", _write(t, '{"input_ids": [1]}\n')], "bad tree .*total_tokens >= 2"),
    (lambda m, t: ["--target", str(m["llama"]), "--draft", str(m["llama/eagle3"]), "--tree", "chain",
                   "--prompts", _write(t, '{"input_ids": [1]}\n')], "use chain:N, dynamic:TOTAL/DEPTH/TOPK"),
    (lambda m, t: ["--target", str(m["llama"]), "--draft", str(m["llama/eagle3"]), "--total-tokens", "8",
                   "--prompts", _write(t, '{"input_ids": [1]}\n')], "--total-tokens is gone.*--tree dynamic:"),
    (lambda m, t: ["--target", str(m["llama"]), "--seed", "-1", "--prompts", _write(t, '{"input_ids": [1]}\n')],
     "seed must be >= 0"),
    (lambda m, t: ["--target", str(m["llama"]), "--prompts", _write(t, '{"input_ids": [1], "seed": "x"}\n')],
     "seed must be an integer"),
    (lambda m, t: ["--target", str(m["llama"]), "--top-p", "0", "--prompts", _write(t, '{"input_ids": [1]}\n')],
     "top_p"),
    (lambda m, t: ["--target", str(m["llama"]), "--max-new-tokens", "-1",
                   "--prompts", _write(t, '{"input_ids": [1]}\n')], "max-new-tokens"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_one_line_error(argv, message, models, tmp_path, capsys):
    assert main(["generate", *argv(models, tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eaglex: error:") and "\n" not in err
    assert pytest.importorskip("re").search(message, err), err


def test_tree_auto_picks_a_measured_shape(models, prompt_file, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--target", str(models["llama"]), "--draft", str(models["llama/eagle3"]),
                 "--prompts", str(prompt_file), "--tree", "auto", "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert "--tree auto:" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 6
