"""Exact index checks need a well-posed top-n: random inputs whose kept and dropped blocks score
within TIE_MARGIN of each other are redrawn. The fast paths sum Eq. 9 in another order than the
reference, so at such a cut either block is a right answer in float32 and an exact index check
would be a coin flip (reference.selection_cut_margin / topn_cut_margin measure the gap)."""

TIE_MARGIN = 1e-5  # relative; float32 rounding of the scores is ~1e-7


def redraw(draw, margin, tries=20, accept=lambda m: True, what="draw"):
  """The first draw(i), i = 0, 1, ..., whose margin(x) >= TIE_MARGIN and accept(margin(x)) holds;
  each rejected try is printed (shown when a test fails), and a run of `tries` rejections fails
  naming `what`."""
  for i in range(tries):
    x = draw(i)
    m = margin(x)
    if m >= TIE_MARGIN and accept(m):
      return x
    print(f"{what}, try {i}: top-n cut margin {m:.2e} (want >= {TIE_MARGIN}), next try")
  raise AssertionError(f"{what}: {tries} tries, none with a top-n choice that is not a near-tie")
