"""The batched self-distillation generator (training/batchgen.py, as eaglex/recipe_smollm2.py uses it): left padding
changes no answer, the preallocated cache changes nothing at all, sampling is seeded, and the batches cover every
prompt."""
import torch

from eaglex import recipe_smollm2 as smollm2
from eaglex.training.batchgen import answer_batch


def _model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 48, (n,), generator=g).tolist() for n in (3, 9, 6, 14)]


def test_batched_greedy_equals_one_at_a_time(models):
    model, prompts = _model(models["llama"]), _prompts()
    tokens, plen = answer_batch(model, prompts, [0.0] * 4, 30, 0, torch.Generator())
    assert tokens.shape == (4, 30) and plen.tolist() == [len(p) for p in prompts]
    for i, p in enumerate(prompts):
        assert tokens[i, :len(p)].tolist() == p
        alone, _ = answer_batch(model, [p], [0.0], 30, 0, torch.Generator())
        assert tokens[i].tolist() == alone[0].tolist()


def test_preallocated_cache_and_seeded_sampling(models):
    model, prompts = _model(models["llama"]), _prompts()
    temps = [0.0, 50.0, 0.0, 50.0]                               # the fixture target is very confident
    runs = [answer_batch(model, prompts, temps, 40, 0, torch.Generator().manual_seed(1), prealloc=pre)[0]
            for pre in (True, False, True)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    other = answer_batch(model, prompts, temps, 40, 0, torch.Generator().manual_seed(2))[0]
    assert torch.equal(other[[0, 2]], runs[0][[0, 2]])          # greedy rows do not depend on the seed
    assert not torch.equal(other[[1, 3]], runs[0][[1, 3]])


def test_jobs_cover_every_prompt():
    prompts = [[1] * n for n in (5, 3, 9, 3, 7, 4, 8, 6, 2, 5)]
    cfg = smollm2.BuildConfig(sampled_fraction=0.3, gen_batch=4, temperature=0.7)
    jobs = smollm2._jobs(cfg, prompts)
    rows = [r for batch in jobs for r in batch]
    assert all(len(b) <= 4 for b in jobs)
    assert sorted(i for i, t in rows if t == 0) == list(range(10))
    assert sorted(i for i, t in rows if t > 0) == [0, 1, 2]
    lens = [len(prompts[i]) for i, _ in rows]
    assert lens == sorted(lens)


def test_instruction_stage_adds_self_instruct_prompts_and_caches(models, tmp_path):
    """The instructions stage: the built-in prompts, then the target's own instructions in its chat template (none
    longer than the window allows), cached by its key."""
    import json
    import shutil

    from test_selfinstruct import LOOSE, _fixture

    from eaglex.training.selfinstruct import SelfInstructConfig

    p = smollm2.Paths(tmp_path)
    shutil.copytree(models["llama"], p.target)
    _, tok = _fixture(models)
    tok.save_pretrained(str(p.target))
    (p.target / "eaglex_gguf.json").write_text(json.dumps({"sha256": "0" * 64}))
    p.work.mkdir()
    (p.work / "builtin_prompts.json").write_text(json.dumps([[1, 2, 3]]))
    si = SelfInstructConfig(count=6, batch=8, follow_up_fraction=0.5, temperature=4.0, max_instruction_tokens=40,
                            max_answer_tokens=40, filters=LOOSE, near_duplicate=0.99, max_batches_per_kept=2.0)
    cfg = smollm2.BuildConfig(self_instruct=si, seq_len=90, min_answer_tokens=20, gen_dtype="float32")
    stats = smollm2.stage_instructions(p, cfg)
    train = json.loads((p.work / "train_prompts.json").read_text())
    assert stats["kept"] == 6 and len(train) == 1 + stats["prompts"] and train[0] == [1, 2, 3]
    assert stats["prompts"] + stats["too_long"] == 6 + stats["two_turn"]
    assert all(len(x) <= 70 for x in train)
    convs = json.loads((p.work / "instructions.json").read_text())
    assert tok.apply_chat_template(convs[0], add_generation_prompt=True, tokenize=True)["input_ids"] == train[1]
    assert smollm2.stage_instructions(p, cfg) == stats                # cached
    off = smollm2.stage_instructions(p, smollm2.BuildConfig(self_instruct=SelfInstructConfig(count=0)))
    assert off == {"kept": 0} and json.loads((p.work / "train_prompts.json").read_text()) == [[1, 2, 3]]


def test_model_card_shows_the_data_and_both_tau_tables():
    """The card a finished build writes (and --publish copies): a missing manifest field would crash the build at
    its very end, after the GPU time is spent."""
    from dataclasses import asdict

    cfg = smollm2.BuildConfig()
    m = {"config": asdict(cfg), "target": {"gguf": "M.gguf", "name": "M", "sha256": "ab" * 32},
         "prompts": {"builtin": 871, "heldout": 16, "honest": 42, "prompt_tokens": [30, 60]},
         "instructions": {"kept": 300, "two_turn": 70, "sampled": 500, "unfinished": 90, "duplicates": 60,
                          "rejected": {"short": 10}, "too_long": 5, "prompts": 365, "batches": 8},
         "selfdistill": {"sequences": 1236, "seq_len": 320, "answer_tokens": 300000, "answers_ended": 900},
         "eagle3": {"steps": 800, "final_loss": 1.0, "seconds": 10.0},
         "eagle1": {"steps": 450, "final_loss": 0.5, "seconds": 9.0},
         "seconds": {"total": 600.0}, "lanes": 2, "device": "cpu",
         "tau_table": "| tree | τ eagle3 |\n| t1 | 3.00 |", "tau_honest_table": "| tree | τ eagle3 |\n| t1 | 2.00 |",
         "sample": {"prompt": "p", "answer": "a", "tau": 2.0}}
    for published in (False, True):
        card = smollm2.model_card(m, published)
        assert "| t1 | 3.00 |" in card and "| t1 | 2.00 |" in card and "heldout_honest.jsonl" in card
        assert "871 built-in chat" in card and "365 instructions the target wrote itself" in card
    m["instructions"] = {"kept": 0}
    assert "wrote itself" not in smollm2.model_card(m, True)
