"""Data sources and the batch iterator: determinism, resume, process split, splits, tasks."""

import os

import numpy as np
import pytest
from ml_collections import ConfigDict

from nsa_jax.training import data

SEED = int.from_bytes(os.urandom(3), "little")  # fresh every run; shown in failure messages


def data_cfg(**kw):
  cfg = dict(source="stdlib", path="", val_path="", token_dtype="uint16", val_percent=2.0,
             max_bytes=4 << 20, num_needles=3, num_kv_pairs=8, num_queries=4)
  cfg.update(kw)
  return ConfigDict(cfg)


def iterator(source, split="train", **kw):
  args = dict(split=split, global_batch=4, seq_len=64, seed=SEED, vocab_size=256)
  args.update(kw)
  return data.BatchIterator(source, **args)


@pytest.fixture(scope="module")
def stdlib():
  return data.make_sources(data_cfg())


def test_stdlib_corpus_is_deterministic_and_split_by_file(stdlib):
  root, files = data.stdlib_files()
  rel = [os.path.relpath(f, root) for f in files]
  assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
  assert not any(part in ("test", "idlelib", "site-packages") for r in rel for part in r.split(os.sep))
  val = [r for r in rel if data._is_val(r, 2.0)]
  assert 0 < len(val) < len(rel) / 10, "about 2% of the files are held out"
  again = data.make_sources(data_cfg())
  for split in ("train", "val"):
    assert again[split].fingerprint == stdlib[split].fingerprint
    assert len(stdlib[split].tokens) > 10_000
  # held-out text is absent from the training stream (probe the middle of the largest val file)
  largest = max(val, key=lambda r: os.path.getsize(os.path.join(root, r)))
  with open(os.path.join(root, largest), "rb") as f:
    text = f.read()
  assert len(text) > 2000
  assert text[len(text) // 2:len(text) // 2 + 300] not in stdlib["train"].tokens.tobytes()


def test_batches_are_a_function_of_seed_and_step(stdlib):
  a, b = iterator(stdlib["train"]), iterator(stdlib["train"])
  first = [next(a) for _ in range(3)]
  assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(first, [next(b) for _ in range(3)]))
  assert not np.array_equal(first[0]["inputs"], first[1]["inputs"]), f"seed {SEED}"
  batch = first[0]
  assert batch["inputs"].shape == (4, 64) and batch["inputs"].dtype == np.int32
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
  other = iterator(stdlib["train"], seed=SEED + 1)
  assert not np.array_equal(next(other)["inputs"], batch["inputs"])


def test_resume_from_state_sees_the_same_batches(stdlib):
  a = iterator(stdlib["train"])
  for _ in range(2):
    next(a)
  saved = a.state()
  expected = [next(a)["inputs"] for _ in range(2)]
  b = iterator(stdlib["train"])
  b.restore(saved)
  assert [next(b)["inputs"].tolist() for _ in range(2)] == [e.tolist() for e in expected]
  c = iterator(stdlib["train"], seed=SEED + 1)
  with pytest.raises(ValueError, match="different data"):
    c.restore(saved)


def test_processes_split_the_global_batch(stdlib):
  whole = iterator(stdlib["train"]).batch(5)["inputs"]
  parts = [iterator(stdlib["train"], process_index=p, process_count=2).batch(5)["inputs"]
           for p in range(2)]
  np.testing.assert_array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("dtype,vocab", [("uint16", 60000), ("uint32", 200_000)])
def test_token_file_windows_are_contiguous(tmp_path, dtype, vocab):
  n = 5000
  offset = int(np.random.default_rng(SEED).integers(0, vocab - n))
  tokens = (np.arange(n) + offset).astype(dtype)  # consecutive ids: a window is a run of +1 steps
  path = tmp_path / "tokens.bin"
  tokens.tofile(path)
  src = data.make_sources(data_cfg(source="tokens", path=str(path), token_dtype=dtype,
                                   val_percent=10.0))
  assert len(src["train"].tokens) == 4500 and len(src["val"].tokens) == 500
  batch = iterator(src["train"], vocab_size=vocab).batch(0)
  seq = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
  assert (np.diff(seq, axis=1) == 1).all()
  assert seq.min() >= offset and seq.max() < offset + 4500
  with pytest.raises(ValueError, match="outside the model vocabulary"):
    iterator(src["val"], vocab_size=offset + 10).batch(0)


def test_text_files_split_by_file(tmp_path):
  for i in range(300):
    (tmp_path / f"doc{i:03d}.txt").write_text(f"document {i} " * 20)
  src = data.make_sources(data_cfg(source="text", path=str(tmp_path), val_percent=5.0))
  train, val = src["train"].tokens.tobytes(), src["val"].tokens.tobytes()
  assert val and train
  val_docs = {int(w) for w in val.split() if w.isdigit()}
  train_docs = {int(w) for w in train.split() if w.isdigit()}
  assert val_docs and not val_docs & train_docs
  with pytest.raises(FileNotFoundError, match="matches no file"):
    data.make_sources(data_cfg(source="text", path=str(tmp_path / "missing*.txt")))


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_retrieval_tasks_weight_the_answer_that_was_hidden(task):
  src = data.make_sources(data_cfg(source=task))
  batch = iterator(src["train"], seq_len=400).batch(3)
  for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
    text = bytes(np.append(inputs, targets[-1]).astype(np.uint8)).decode()
    answer = bytes(targets[weights > 0].astype(np.uint8)).decode()
    assert len(answer) == 5 and answer.isdigit()
    assert text.endswith(answer)
    assert text.count(answer) >= 2, f"the answer also appears in the hidden fact (seed {SEED})"
    assert len(text) == 401


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_extra_questions_and_context_weight(task):
  """num_questions=Q: Q answered questions, each after its fact; context_loss_weight on the rest."""
  src = data.make_sources(data_cfg(source=task, num_questions=3, context_loss_weight=0.25))
  assert src["train"].fingerprint["num_questions"] == 3
  batch = iterator(src["train"], seq_len=400).batch(2)
  for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
    text = bytes(np.append(inputs, targets[-1]).astype(np.uint8)).decode()
    answers = bytes(targets[weights == 1.0].astype(np.uint8)).decode()
    assert len(answers) == 15 and answers.isdigit() and text.endswith(answers[-5:])
    assert set(weights.tolist()) == {0.25, 1.0}, f"seed {SEED}"
    asked = text.split("? ")[1:]  # each question's answer: the 5 digits after "is " up to "?"
    assert len(asked) == 3
    for q, a in zip(asked, [answers[i:i + 5] for i in range(0, 15, 5)]):
      assert q.split(" is ", 1)[1][:5] == a, f"answer {a} not the digits after question (seed {SEED})"
      first_fact = text.index(a)  # the value first appears in its fact, before any question
      assert first_fact < text.index("?") and text[first_fact - 3:first_fact] == "is "
  # the defaults are the original task: no new fingerprint fields, answers only
  plain = data.make_sources(data_cfg(source=task))["train"]
  assert "num_questions" not in plain.fingerprint and "context_loss_weight" not in plain.fingerprint
  with pytest.raises(ValueError, match="num_questions"):
    iterator(data.make_sources(data_cfg(source=task, num_questions=9))["train"], seq_len=300).batch(0)


def _passkey(**kw):
  return data.make_sources(data_cfg(source="passkey", num_questions=5, context_loss_weight=0.01,
                                    **kw))["train"]


def test_single_question_fraction_zero_keeps_every_row():
  """The default draws nothing extra: rows and fingerprint are those of a config without the field."""
  plain, zero = _passkey(), _passkey(single_question_fraction=0.0)
  assert zero.fingerprint == plain.fingerprint and "single_question_fraction" not in zero.fingerprint

  class NoExtraDraws:  # a row at the default may draw only what it drew before the field existed
    def __init__(self, rng):
      self.rng = rng

    def integers(self, *a, **k):
      return self.rng.integers(*a, **k)

    def random(self, *a, **k):
      raise AssertionError("a row at single_question_fraction=0 drew rng.random()")

  seq, _ = zero.row(NoExtraDraws(np.random.default_rng(SEED)), 513)
  again, _ = plain.row(np.random.default_rng(SEED), 513)
  np.testing.assert_array_equal(seq, again)
  for step in range(3):
    a, b = iterator(plain, seq_len=512).batch(step), iterator(zero, seq_len=512).batch(step)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert _passkey(single_question_fraction=0.5).fingerprint["single_question_fraction"] == 0.5
  for bad in (-0.1, 1.5):
    with pytest.raises(ValueError, match="single_question_fraction.*Fix"):
      _passkey(single_question_fraction=bad)
  with pytest.raises(ValueError, match="num_questions=1.*Fix"):
    data.make_sources(data_cfg(source="passkey", single_question_fraction=0.5))


def test_single_question_rows_put_the_fact_at_a_uniform_distance():
  """f = 1: every row asks once, at the end, and the answer's only earlier copy of the key is the
  fact, anywhere in the row; f = 0.5: about half the rows do."""
  length, rows = 1024, 300
  one = _passkey(single_question_fraction=1.0)
  batch = iterator(one, seq_len=length, global_batch=8).batch(SEED % 97)
  assert batch["inputs"].shape == (8, length)
  for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
    text = bytes(np.append(inputs, targets[-1]).astype(np.uint8)).decode()
    assert text.count("?") == 1 and (weights == 1.0).sum() == 5, f"seed {SEED}"
    assert text.index("The pass key is") < text.index("?")
  # the needle source too: one question, after all the facts, rows of the full length
  needle = data.make_sources(data_cfg(source="needle", num_questions=4,
                                      single_question_fraction=1.0))["train"]
  for r in range(4):
    seq, weights = needle.row(data._row_rng(SEED, "train", 0, r), length + 1)
    text = bytes(seq.astype(np.uint8)).decode()
    assert len(seq) == length + 1 and text.count("?") == 1 and (weights == 1.0).sum() == 5
    assert text.rindex("The value of key") < text.index("?")
  d = data.retrieval_distances(one, length, rows, seed=SEED)
  assert d.size == rows and d.min() > 0 and d.max() < length
  far = (d >= length // 2).mean()
  assert 0.35 < far < 0.65, f"distances not uniform over the row: {far:.2f} beyond half (seed {SEED})"
  assert (d >= 0.9 * length).any()
  # with 5 questions the nearest copy is mostly the previous question: far answers are rare
  five = data.retrieval_distances(_passkey(), length, rows, seed=SEED)
  assert five.size == 5 * rows and (five >= length // 2).mean() < 0.1, f"seed {SEED}"
  half = data.retrieval_distances(_passkey(single_question_fraction=0.5), length, rows, seed=SEED)
  singles = (5 * rows - half.size) / 4  # each single-question row has 4 answers fewer
  assert 0.3 * rows < singles < 0.7 * rows, f"{singles} single-question rows of {rows} (seed {SEED})"


def test_retrieval_distances_measures_back_to_the_key():
  """One row by hand: the answer's distance is its start minus the fact's digits' start."""
  src = _passkey(single_question_fraction=1.0)
  seq, weights = src.row(data._row_rng(SEED, "train", 0, 0), 301)
  text = bytes(seq.astype(np.uint8))
  key = text[text.index(b"The pass key is ") + 16:][:5]
  answer = int(np.flatnonzero(weights == 1.0)[0]) + 1
  assert text[answer:answer + 5] == key
  assert data.retrieval_distances(src, 300, 1, seed=SEED).tolist() == [answer - text.index(key)]
  with pytest.raises(ValueError, match="context_loss_weight"):
    data.retrieval_distances(data.make_sources(data_cfg(source="passkey", context_loss_weight=1.0))
                             ["train"], 300, 1)
  with pytest.raises(ValueError, match="passkey"):
    data.retrieval_distances(data.make_sources(data_cfg(source="mqar"))["train"], 300, 1)


def test_mqar_values_follow_their_keys():
  src = data.make_sources(data_cfg(source="mqar"))
  batch = iterator(src["val"], seq_len=128, split="val").batch(0)
  for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
    table = dict(zip(inputs[0:16:2].tolist(), inputs[1:16:2].tolist()))
    asked = np.nonzero(weights)[0]
    assert len(asked) == 4
    for j in asked:
      assert table[int(inputs[j])] == int(targets[j])
  with pytest.raises(ValueError, match="seq_len too short"):
    iterator(src["train"], seq_len=16).batch(0)


def test_unknown_source_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown"):
    data.make_sources(data_cfg(source="stdlb"))


def test_token_file_problems_name_the_field_and_the_fix(tmp_path):
  missing = str(tmp_path / "missing.bin")
  with pytest.raises(FileNotFoundError, match=r"config.data.path=.*missing.bin.*no such file"):
    data.make_sources(data_cfg(source="tokens", path=missing, token_dtype="uint16"))
  empty = tmp_path / "empty.bin"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match=r"config.data.path=.*empty.bin.* is empty"):
    data.make_sources(data_cfg(source="tokens", path=str(empty), token_dtype="uint16"))
  odd = tmp_path / "odd.bin"
  odd.write_bytes(bytes(4097))
  with pytest.raises(ValueError, match=r"4097 bytes, not a whole number of uint32.*token_dtype"):
    data.make_sources(data_cfg(source="tokens", path=str(odd), token_dtype="uint32"))
  good = tmp_path / "good.bin"
  np.arange(5000, dtype=np.uint16).tofile(good)
  with pytest.raises(FileNotFoundError, match=r"config.data.val_path="):
    data.make_sources(data_cfg(source="tokens", path=str(good), token_dtype="uint16",
                               val_path=missing))


# ------------------------------------------------------------------ document masking -----------

def test_segment_ids_count_the_end_tokens_before_each_position():
  rows = np.array([[5, 0, 7, 7, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(data.segment_ids(rows, 0),
                                [[0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]])
  assert data.segment_ids(rows, 0).dtype == np.int32


def test_document_mask_batches_carry_segment_ids_of_their_inputs():
  rng = np.random.default_rng(SEED)
  tokens = rng.integers(1, 50, 4000).astype(np.int32)
  tokens[rng.choice(4000, 60, replace=False)] = 7  # documents end at 7
  src = data.WindowSource(tokens, {"source": "synthetic"})
  plain = iterator(src, seq_len=256).batch(3)
  masked = iterator(src, seq_len=256, eos_id=7).batch(3)
  assert "segment_ids" not in plain
  for k in plain:  # the same rows, only the ids added
    np.testing.assert_array_equal(plain[k], masked[k])
  seg, inp = masked["segment_ids"], masked["inputs"]
  assert seg.shape == inp.shape and (seg[:, 0] == 0).all()
  # an id steps up exactly at the position after an end token
  np.testing.assert_array_equal(np.diff(seg, axis=1), (inp[:, :-1] == 7).astype(np.int32))
  assert seg.max() > 0, f"no document boundary drawn (seed {SEED})"


def test_document_end_id_per_source_and_its_refusals():
  assert data.document_end_id(data_cfg()) is None  # off unless asked for
  assert data.document_end_id(data_cfg(document_mask=False, eos_id=3)) is None
  assert data.document_end_id(data_cfg(document_mask=True, eos_id=-1)) == 0  # stdlib: byte 0
  assert data.document_end_id(data_cfg(source="text", document_mask=True, eos_id=0)) == 0
  assert data.document_end_id(data_cfg(source="tokens", document_mask=True, eos_id=50256)) == 50256
  for cfg, msg in ((data_cfg(source="tokens", document_mask=True, eos_id=-1), "eos_id=<"),
                   (data_cfg(source="text", document_mask=True, eos_id=5), "byte 0"),
                   (data_cfg(source="passkey", document_mask=True), "no documents"),
                   (data_cfg(source="mqar", document_mask=True), "no documents"),
                   (data_cfg(document_mask=1), "True or False"),
                   (data_cfg(source="tokens", document_mask=True, eos_id=2.0), "integer")):
    with pytest.raises(ValueError, match=msg):
      data.document_end_id(cfg)
  with pytest.raises(ValueError, match="eos_id=300 is outside the model vocabulary"):
    iterator(data.WindowSource(np.zeros(100, np.int32), {}), eos_id=300)
