"""nsa_jax.training.hlo_report: parsing collectives out of optimized HLO text."""

from nsa_jax.training import hlo_report

HLO = """
  %all-gather.1 = bf16[8,768]{1,0} all-gather(bf16[4,768]{1,0} %p), channel_id=1, dimensions={0}, metadata={op_name="state['params']['embed']"}
  %ags = (f32[2,8192,64]{2,1,0}, f32[4,8192,64]{2,1,0}) all-gather-start(f32[2,8192,64]{2,1,0} %x), dimensions={0}, metadata={op_name="jit(step)/nsa_attention/shard_map"}
  %agd = f32[4,8192,64]{2,1,0} all-gather-done((f32[2,8192,64]{2,1,0}, f32[4,8192,64]{2,1,0}) %ags)
  %agv = ((bf16[384,3072]{1,0}, bf16[384,768]{1,0}), (bf16[768,3072]{1,0}, bf16[768,768]{1,0})) all-gather-start(bf16[384,3072]{1,0} %a, bf16[384,768]{1,0} %b), dimensions={0}, metadata={op_name="state['params']['mlp']"}
  %ar = f32[] all-reduce(f32[] %l), to_apply=%add, metadata={op_name="jit(step)/reduce_sum"}
  %add.2 = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %b)
"""


def test_collectives_parsed_with_shapes_bytes_and_ops():
  recs = hlo_report.collectives(HLO)
  assert [(r["kind"], r["shapes"]) for r in recs] == [
      ("all-gather", [[8, 768]]), ("all-gather", [[4, 8192, 64]]),
      ("all-gather", [[768, 3072], [768, 768]]), ("all-reduce", [[]])]
  assert recs[0]["bytes"] == 8 * 768 * 2 and recs[1]["bytes"] == 4 * 8192 * 64 * 4
  assert recs[2]["bytes"] == (768 * 3072 + 768 * 768) * 2  # a combined all-gather: both results
  s = hlo_report.summarize(recs, seq_len=8192)
  assert s["total"] == 4 and s["per_kind"]["all-gather"]["count"] == 3
  # a parameter whose width equals T is not an activation with a sequence dimension
  assert hlo_report.summarize(recs, seq_len=768)["with_sequence_dim"] == []
  assert [r["shape"] for r in s["with_sequence_dim"]] == [[4, 8192, 64]]
  assert [r["op_name"] for r in s["in_attention_op"]] == ["jit(step)/nsa_attention/shard_map"]
