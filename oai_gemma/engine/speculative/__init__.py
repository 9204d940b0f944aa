"""Speculative decoding: draft tokens proposed without the model, all checked by one forward of the model.

A running sequence may carry up to k draft tokens into a step (`Sequence.draft`): the step computes its last token
and the drafts as decode rows at consecutive positions (`StepItem.num_logits` = k + 1 logits rows), the sampler
draws a token from each row as if the drafts before it were accepted (`verify.py`), and the longest prefix of
drafts the model drew itself is kept, plus the model's own next token. Rejected positions are rolled back before
the scheduler counts the step (`num_computed` counts accepted tokens only), so their KV is overwritten later and
never indexed for reuse. Drafts come from the sequence's own tokens (`lookup.py`, prompt lookup) or from the
request's Predicted Output (`prediction.py`); `planner.py` decides how many each sequence may carry this step.
"""
