"""Recording traffic (``generate(..., record=FOLDER)``, ``heads.io.traffic``): the output is the same with recording
on and off, one prompt and every row of a batch; what is stored equals the backbone's own states and tokens; a killed
writer leaves nothing half-written; a folder recorded by other heads is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_eagle3, random_mtp, repeating_prompts, tiny_model

from tokenmaxx.heads.io import traffic
from tokenmaxx.heads.modeling import backbone_features
from tokenmaxx.inference import SpeculativeGenerator, record


def _prompts(model, n=4, seed=5):
    return [(p[0].tolist(), new) for p, new in repeating_prompts(model.config.vocab_size, seed=seed, n=n)]


def _check_store(folder, model, heads, expected: list[tuple[list[int], list[int]]]) -> None:
    """Every recorded row holds its prompt's tail and new tokens, and features equal to one plain backbone forward
    over the whole sequence at the heads' feature layers."""
    reader = traffic.TrafficReader(folder)
    assert len(reader) == len(expected)
    for i, (prompt, new) in enumerate(expected):
        full = torch.tensor([prompt + new])
        keep = max(0, len(prompt) - record.PROMPT_KEPT)  # the prompt's last PROMPT_KEPT positions
        assert reader.ids(i).tolist() == (prompt + new)[keep:] and reader.row_len(i) == len(prompt + new) - keep
        assert reader.prompt_len(i) == len(prompt) - keep
        with torch.no_grad():
            out = model(full, output_hidden_states=True)
            states = backbone_features(out.hidden_states, heads.feature_layers)[0]
        torch.testing.assert_close(reader.features(i), states[keep:-1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(reader.features(i, 2), states[keep + 2:-1], atol=2e-5, rtol=1e-4)
        # the top-k at each answer position: the plain forward's log-probabilities there, most likely first
        ids, logprobs = reader.topk(i)
        reference = out.logits[0, len(prompt) - 1:-1].float().log_softmax(-1)  # [new, V]
        assert ids.shape == logprobs.shape == (len(new), record.TOPK) and ids.dtype == torch.int32
        torch.testing.assert_close(logprobs, reference.topk(record.TOPK).values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logprobs, reference.gather(1, ids.long()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,draft", [("eagle3", "hybrid"), ("eagle3", "heads"), ("mtp", "hybrid")])
def test_recording_changes_no_output_and_stores_the_backbones_states(tmp_path, kind, draft, monkeypatch):
    monkeypatch.setattr(record, "PROMPT_KEPT", 6)  # shorter than some prompts: their heads are cut
    model = tiny_model("llama", seed=1)
    heads = random_eagle3(model, scale=0.05) if kind == "eagle3" else random_mtp(model, scale=0.05)
    gen = SpeculativeGenerator(model, heads, draft=draft, costs=None)
    prompts = _prompts(model)
    expected = []
    for prompt, new in prompts:  # one prompt a call: one shard each
        plain = gen.generate(prompt, max_new_tokens=new)
        recorded = gen.generate(prompt, max_new_tokens=new, record=tmp_path / "one")
        assert recorded.new_tokens == plain.new_tokens
        assert recorded.stats.to_dict()["accepted_hist"] == plain.stats.to_dict()["accepted_hist"]
        expected.append((prompt, plain.new_tokens))
    assert len(traffic.shards(tmp_path / "one")) == len(prompts)
    _check_store(tmp_path / "one", model, heads, expected)

    rows = [p for p, _ in prompts]  # a batch: every row recorded, in one shard
    plain = gen.generate(rows, max_new_tokens=[n for _, n in prompts])
    recorded = gen.generate(rows, max_new_tokens=[n for _, n in prompts], record=tmp_path / "batch")
    assert recorded.new_tokens == plain.new_tokens == [new for _, new in expected]
    assert len(traffic.shards(tmp_path / "batch")) == 1
    _check_store(tmp_path / "batch", model, heads, expected)


def test_rows_cut_at_eos_and_sampled_rows_are_recorded_as_emitted(tmp_path):
    model = tiny_model("llama", seed=3)
    prompts = _prompts(model, n=3, seed=7)
    reference = SpeculativeGenerator(model, random_eagle3(model, scale=0.05), costs=None)
    early = reference.generate(prompts[1][0], max_new_tokens=30).new_tokens[4]
    model.generation_config.eos_token_id = early  # one row stops early, at an EOS inside an accepted path
    heads = random_eagle3(model, scale=0.05)
    gen = SpeculativeGenerator(model, heads, costs=None)
    out = gen.generate([p for p, _ in prompts], max_new_tokens=30, record=tmp_path / "eos")
    assert any(row[-1] == early and len(row) < 30 for row in out.new_tokens)
    _check_store(tmp_path / "eos", model, heads, [(p, new) for (p, _), new in zip(prompts, out.new_tokens)])
    sampled = gen.generate(prompts[0][0], max_new_tokens=20, do_sample=True, temperature=1.0, seed=3,
                           record=tmp_path / "sampled")
    again = gen.generate(prompts[0][0], max_new_tokens=20, do_sample=True, temperature=1.0, seed=3)
    assert sampled.new_tokens == again.new_tokens
    reader = traffic.TrafficReader(tmp_path / "sampled")
    assert reader.sampled(0) and not traffic.TrafficReader(tmp_path / "eos").sampled(0)
    _check_store(tmp_path / "sampled", model, heads, [(prompts[0][0], sampled.new_tokens)])


def test_a_killed_writer_leaves_whole_shards_only(tmp_path, monkeypatch):
    model = tiny_model("llama", seed=1)
    heads = random_eagle3(model, scale=0.05)
    gen = SpeculativeGenerator(model, heads, costs=None)
    prompt, new = _prompts(model, n=1)[0]
    gen.generate(prompt, max_new_tokens=new, record=tmp_path)

    def killed(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(traffic, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        gen.generate(prompt, max_new_tokens=new, record=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != traffic.META) == \
        [p.name for p in traffic.shards(tmp_path)]
    assert len(traffic.TrafficReader(tmp_path)) == 1


def test_rows_without_top_k_still_read_beside_rows_with_it(tmp_path):
    """Shards written before the top-k was recorded (or by a caller that has none) read as before, beside new ones;
    a row's top-k must cover exactly its answer positions."""
    features = torch.randn(7, 3)
    old = traffic.TrafficRow(ids=torch.arange(8), prompt_len=3, features=features)
    new = traffic.TrafficRow(ids=torch.arange(6), prompt_len=2, features=features[:5],
                             topk_ids=torch.arange(8, dtype=torch.int32).view(4, 2),
                             topk_logprobs=-torch.arange(8.0).view(4, 2))
    folder = traffic.open_store(tmp_path, {"format": traffic.FORMAT, **dict.fromkeys(traffic.IDENTITY), "lookback": 4})
    traffic.append(folder, [old])
    traffic.append(folder, [new, new])
    reader = traffic.TrafficReader(folder)
    assert reader.topk(0) is None and reader.ids(0).tolist() == list(range(8))
    for i in (1, 2):
        ids, logprobs = reader.topk(i)
        assert ids.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and logprobs[3].tolist() == [-6.0, -7.0]
        torch.testing.assert_close(reader.features(i), features[:5])
    with pytest.raises(ValueError, match="4 answer positions needs top-k"):
        traffic.TrafficRow(ids=torch.arange(6), prompt_len=2, features=features[:5],
                           topk_ids=torch.zeros(3, 2, dtype=torch.int32), topk_logprobs=torch.zeros(3, 2))


def test_bad_record_folders_are_refused_before_any_work(tmp_path):
    model = tiny_model("llama", seed=1)
    prompt, new = _prompts(model, n=1)[0]
    SpeculativeGenerator(model, random_eagle3(model), costs=None).generate(prompt, max_new_tokens=new,
                                                                           record=tmp_path / "e3")
    other = SpeculativeGenerator(model, random_eagle3(model, feature_layers=(1, 2, 0)), costs=None)
    with pytest.raises(ValueError, match=r"other heads or another backbone \(feature_layers: recorded \[0, 1, 2\]"):
        other.generate(prompt, max_new_tokens=new, record=tmp_path / "e3")
    assert len(traffic.shards(tmp_path / "e3")) == 1
    lookup = SpeculativeGenerator(model, None, draft="lookup", costs=None)
    with pytest.raises(ValueError, match="needs a generator whose heads draft"):
        lookup.generate(prompt, max_new_tokens=new, record=tmp_path / "lookup")
    assert not (tmp_path / "lookup").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        SpeculativeGenerator(model, random_eagle3(model), costs=None).generate(prompt, record=tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="no meta.json in it"):
        traffic.TrafficReader(tmp_path)


# ---- adapt: the heads learn the recorded traffic ---------------------------------------------------------------------
def _kind_a(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts of one kind: random runs of tokens from a narrow band of the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(40, 56, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _mean_tau(gen, prompts, new=24) -> float:
    outs = [gen.generate(p, max_new_tokens=new) for p in prompts]
    return sum(o.stats.mean_tau for o in outs) / len(outs)


@pytest.mark.slow
@pytest.mark.parametrize("prompt_context", [None, 16])  # the heads' own (4 positions), or every prompt position
def test_adapt_raises_acceptance_on_prompts_of_the_recorded_kind(tmp_path, backbone_dir, data_dir, prompt_context):
    from tokenmaxx.heads import load_backbone, load_heads
    from tokenmaxx.training.adapt import AdaptConfig, adapt

    model, _ = load_backbone(str(backbone_dir), dtype="float32")
    heads = random_eagle3(model, seed=4, scale=0.3)
    heads.save_pretrained(tmp_path / "heads")
    served = SpeculativeGenerator(model, load_heads(str(tmp_path / "heads")), draft="heads", costs=None)
    vocab = model.config.vocab_size
    rows = _kind_a(vocab, 48, seed=0)
    folders = [tmp_path / "traffic", tmp_path / "traffic-2"] if prompt_context else [tmp_path / "traffic"]
    for first in range(0, len(rows), 8):  # traffic: batches of 8 (into two folders, adapted to as one)
        served.generate(rows[first: first + 8], max_new_tokens=24, record=folders[first // 8 % len(folders)])
    others = _kind_a(vocab, 8, seed=1)  # prompts of the same kind, never recorded
    before = _mean_tau(served, others)
    replay = data_dir
    if prompt_context:  # a folder of make-data parts (as distilled/ keeps the shipped heads' data): merged first
        import shutil

        replay = tmp_path / "parts"
        shutil.copytree(data_dir, replay / "part-000")
    report = adapt(AdaptConfig(heads=str(tmp_path / "heads"), traffic=[str(f) for f in folders],
                               output_dir=str(tmp_path / "run"), replay=str(replay), replay_share=0.25,
                               replay_eval=8, dtype="float32", max_steps=80, lr=1e-2, warmup=2, micro_batch_size=8,
                               seq_len=None if prompt_context else 48, save_every=20, held_out=0.2,
                               prompt_context=prompt_context))  # None: each row's whole answer
    assert report["shipped"], report
    assert report["after"]["traffic"]["tree_tau_empirical"] > report["before"]["traffic"]["tree_tau_empirical"]
    assert set(report["before"]) == {"traffic", "replay"} and report["rows"]["replay_train"] > 0
    assert sum(report["rows"][k] for k in ("traffic_train", "traffic_held_out")) == len(rows)  # every row, whole
    adapted = SpeculativeGenerator(model, load_heads(str(tmp_path / "run" / "heads")), draft="heads", costs=None)
    after = _mean_tau(adapted, others)
    assert after > before + 0.2, (before, after, report)
    for p in others[:3]:  # still the backbone's own output
        assert adapted.generate(p, max_new_tokens=24).new_tokens == served.generate(p, max_new_tokens=24).new_tokens
    assert load_heads(str(tmp_path / "run" / "heads")).config.prompt_context == prompt_context
    assert (tmp_path / "run" / "replay-data" / "state.json").is_file() == bool(prompt_context)
    extra = load_heads(str(tmp_path / "run" / "heads")).config.extra
    assert extra["metrics_before"] == json.loads((tmp_path / "run" / "metrics_before.json").read_text())
    assert torch.equal(load_heads(str(tmp_path / "run" / "heads")).draft_vocab, heads.draft_vocab) \
        if heads.draft_vocab is not None else load_heads(str(tmp_path / "run" / "heads")).draft_vocab is None
    # adapted again (tomorrow's traffic): the same replay rows are held out as the first adapt held out, which
    # neither adapt trained on, so the adapted heads score there as the first adapt reported
    again = adapt(AdaptConfig(heads=str(tmp_path / "run" / "heads"), traffic=[str(f) for f in folders],
                              output_dir=str(tmp_path / "run-2"), replay=str(replay), replay_share=0.25,
                              replay_eval=8, dtype="float32", max_steps=2, lr=1e-4, warmup=1, micro_batch_size=8,
                              seq_len=None if prompt_context else 48, held_out=0.2, prompt_context=prompt_context))
    assert again["rows"]["replay_held_out"] == report["rows"]["replay_held_out"]
    for part in ("replay", "traffic"):
        assert again["before"][part]["tree_tau_empirical"] == pytest.approx(
            report["after"][part]["tree_tau_empirical"], abs=1e-4), (part, again, report)


def test_adapt_kl_reads_each_targets_recorded_top_k_and_refuses_traffic_without_it(tmp_path, backbone_dir,
                                                                                   data_dir, monkeypatch):
    """``adapt --loss kl``: the teacher a batch gives at window position s is the top-k the backbone computed there
    (its most likely token: the one it emitted at s + 1), through both window offsets (the prompt tail an example
    skips, the positions a window skips); positions outside the answer have none; replay rows have none. A run
    trains on it; traffic recorded without a top-k is refused before any work."""
    import dataclasses

    from tokenmaxx.heads import load_backbone
    from tokenmaxx.training.adapt import AdaptConfig, MixedFeatures, RecordedFeatures, Recordings, adapt, \
        traffic_examples
    from tokenmaxx.training.batches import collate

    model, _ = load_backbone(str(backbone_dir), dtype="float32")
    random_eagle3(model, seed=4, scale=0.3).save_pretrained(tmp_path / "heads")
    gen = SpeculativeGenerator(model, random_eagle3(model, seed=4, scale=0.3), draft="heads", costs=None)
    rows = _kind_a(model.config.vocab_size, 12, seed=0)
    for first in range(0, len(rows), 4):
        gen.generate(rows[first: first + 4], max_new_tokens=16, record=tmp_path / "traffic")
    reader = Recordings([str(tmp_path / "traffic")])
    examples, _, keys = traffic_examples(reader, seq_len=64, share=0.2, context=6)  # skips the longer prompts' heads
    recorded = RecordedFeatures(reader)
    features = MixedFeatures({e.row: (recorded, key) for e, key in zip(examples, keys)}, torch.device("cpu"),
                             torch.float32)
    data = type("Data", (), {"examples": {e.row: e for e in examples}})()
    checked = 0
    for context in (6, 2):  # windows from the example's start, and windows that skip prompt positions too
        batch = collate(data, [e.row for e in examples], context)
        ids, logp = features.teacher(batch)
        assert ids.shape == logp.shape == (*batch.input_ids.shape, record.TOPK)
        for b, (row, start, length) in enumerate(zip(batch.rows, batch.starts, batch.lengths.tolist())):
            i, skip = keys[row]
            top_ids, top_logp = reader.topk(i)
            answer = int(batch.answer_start[b])
            for s in range(batch.input_ids.shape[1]):
                if answer - 1 <= s < length - 1:  # the backbone chose token s + 1 here
                    j = skip + start + s - (reader.prompt_len(i) - 1)
                    assert ids[b, s].tolist() == top_ids[j].tolist() and torch.equal(logp[b, s], top_logp[j])
                    assert ids[b, s, 0] == batch.input_ids[b, s + 1]
                    checked += 1
                else:
                    assert torch.isinf(logp[b, s]).all()
    assert checked > 100

    def run(folders, out, **kw):
        return adapt(AdaptConfig(heads=str(tmp_path / "heads"), traffic=[str(f) for f in folders],
                                 output_dir=str(tmp_path / out), replay=str(data_dir), replay_share=0.25,
                                 replay_eval=4, dtype="float32", max_steps=3, lr=1e-3, warmup=1, micro_batch_size=4,
                                 held_out=0.2, prompt_context=None, **kw))

    report = run([tmp_path / "traffic"], "run", loss="kl")
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert report["steps"] == 3 and all(r["head_kl"][0] > 0 for r in steps if r.get("split") == "train")
    old_row = record.Recording.row  # an older tokenmaxx's recording: no top-k
    monkeypatch.setattr(record.Recording, "row", lambda self, sampled: dataclasses.replace(
        old_row(self, sampled), topk_ids=None, topk_logprobs=None))
    gen.generate(rows[:4], max_new_tokens=16, record=tmp_path / "old")
    with pytest.raises(ValueError, match="--loss kl learns from the backbone's recorded top-k, but --traffic .*old "
                                         "was recorded without it"):
        run([tmp_path / "old"], "run-old", loss="kl")
    assert not (tmp_path / "run-old").exists()
    with pytest.raises(ValueError, match="--loss must be one of"):
        AdaptConfig(heads="h", traffic="t", output_dir="o", loss="mse")


def test_traffic_windows_read_the_prompt_tail_then_the_answer_and_count_what_seq_len_cuts(caplog):
    from tokenmaxx.training.adapt import traffic_examples

    class Reader:  # three recorded rows: (prompt, answer) lengths
        rows = [(8, 4), (8, 9), (3, 0)]

        def __len__(self):
            return len(self.rows)

        def prompt_len(self, i):
            return self.rows[i][0]

        def row_len(self, i):
            return sum(self.rows[i])

        def ids(self, i):
            return torch.arange(sum(self.rows[i])) + 100 * i

    with caplog.at_level("WARNING"):
        examples, held, keys = traffic_examples(Reader(), seq_len=10, share=0.5, context=3)
    assert keys == [(0, 4), (1, 4)]  # the prompt's last 4 positions (lookback 3 + the last one); row 2 has no answer
    assert [(e.ids.tolist(), e.prompt_len) for e in examples] == [(list(range(4, 12)), 4), (list(range(104, 114)), 4)]
    assert len(held) == 2 and "cuts the answers of 1 of 3 recorded rows (3 answer tokens not trained on, 1 rows " \
        "left without any)" in caplog.text


# ---- online adaptation -----------------------------------------------------------------------------------------------
def test_online_adaptation_changes_the_heads_and_never_the_output():
    from tokenmaxx.inference import OnlineAdapt

    model = tiny_model("llama", seed=1)
    plain = SpeculativeGenerator(model, random_eagle3(model, seed=4, scale=0.3), draft="heads", costs=None)
    heads = random_eagle3(model, seed=4, scale=0.3)
    start = {k: v.clone() for k, v in heads.state_dict().items()}
    online = SpeculativeGenerator(model, heads, draft="heads", costs=None,
                                  online=OnlineAdapt(every=64, steps=8, lr=1e-2, batch_rows=4, buffer_rows=6))
    vocab = model.config.vocab_size
    prompts, others = _kind_a(vocab, 24, seed=0), _kind_a(vocab, 6, seed=1)
    before = _mean_tau(plain, others)  # the same weights, not adapting
    for first in range(0, len(prompts), 4):  # batches and single prompts alike
        rows = prompts[first: first + 4]
        assert online.generate(rows, max_new_tokens=24).new_tokens == \
            plain.generate(rows, max_new_tokens=24).new_tokens
        assert online.generate(rows[0], max_new_tokens=24).new_tokens == \
            plain.generate(rows[0], max_new_tokens=24).new_tokens
    learner = online.online
    assert learner.updates >= 5 and len(learner.buffer) == 6 and learner.seen_rows == 30
    assert any(not torch.equal(start[k], v) for k, v in heads.state_dict().items() if k != "draft_vocab")
    adapted = SpeculativeGenerator(model, heads, draft="heads", costs=None)  # the adapted weights, frozen
    assert _mean_tau(adapted, others) > before + 0.1
    with pytest.raises(ValueError, match="online adaptation trains the heads on what they serve"):
        SpeculativeGenerator(model, None, draft="lookup", costs=None, online=OnlineAdapt())
    with pytest.raises(ValueError, match="OnlineAdapt.every must be a positive integer"):
        OnlineAdapt(every=0)


def test_adapt_refuses_traffic_it_cannot_use_before_any_training(tmp_path, backbone_dir):
    from tokenmaxx.heads import load_backbone
    from tokenmaxx.training.adapt import AdaptConfig, adapt

    model, _ = load_backbone(str(backbone_dir), dtype="float32")
    random_eagle3(model).save_pretrained(tmp_path / "served")
    random_eagle3(model, feature_layers=(1, 2, 0)).save_pretrained(tmp_path / "other")
    gen = SpeculativeGenerator(model, random_eagle3(model), costs=None)
    for prompt in _kind_a(model.config.vocab_size, 3, seed=0):
        gen.generate(prompt, max_new_tokens=8, record=tmp_path / "traffic")

    def run(**kw):
        return adapt(AdaptConfig(**{"heads": str(tmp_path / "served"), "traffic": str(tmp_path / "traffic"),
                                    "output_dir": str(tmp_path / "run"), "dtype": "float32", **kw}))

    with pytest.raises(ValueError, match=r"not recorded for these heads \(feature_layers: recorded \[0, 1, 2\]"):
        run(heads=str(tmp_path / "other"))
    with pytest.raises(ValueError, match="lookback: recorded 1023 prompt positions, --prompt_context needs >= 1999"):
        run(prompt_context=2000)
    with pytest.raises(ValueError, match="holds 3 usable rows .* too few to adapt and score"):
        run(held_out=0.01)
    with pytest.raises(ValueError, match=r"0 usable rows \(0 held out\) of 3 recorded: .* or raise --seq_len 3: a "
                                         r"row reads up to 512 prompt positions \(--prompt_context\) before"):
        run(seq_len=3)  # every prompt (5-11 tokens) is read whole first: no answer token fits
    with pytest.raises(FileNotFoundError, match="no such folder; expected a folder written by generate"):
        run(traffic=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--held_out must be in"):
        AdaptConfig(heads="h", traffic="t", output_dir="o", held_out=1.0)
    assert not (tmp_path / "run").exists()  # nothing was written
