"""DiLoCo through gradq: hosts take ``sync_every`` local steps, then average their pseudo-gradients once.

DiLoCo (Douillard et al., arXiv 2311.08105) trades per-step averaging for an
outer step every H inner steps: each host trains its own copy of the model
with its inner optimizer (AdamW, say) on its own data, then every host pushes
its *pseudo-gradient* (the global parameters minus its local ones), the mean
of those becomes the gradient of an outer optimizer (Nesterov SGD), and every
host starts the next H steps from the new global parameters. The link carries
one compressed copy of the model each way per H steps instead of per step.

How it runs here:

- Each host is one member of an elastic gradq job (``elastic_hosts`` is the
  number of hosts the job starts with): a single process (plain ``python``, no
  process group needed), a DDP group inside the host (its ranks reduce the
  pseudo-gradient together and push one copy, as two-level aggregation
  does), or an FSDP2 group inside the host (each
  rank pushes the pseudo-gradient of its own shards, so the host pushes one
  copy of the model between its ranks, none gathered). The inner steps use
  the host's own collectives; only outer rounds cross the slow link.
- Outer round r is step r of the job; the model's trainable parameters are
  laid end to end in buckets of at most ``bucket_elements``, bucket k is round
  key k. Pseudo-gradients are compressed with the session's grid and error
  feedback (per parameter, kept across rounds and checkpoints).
- By default (``outer_step="aggregator"``) the outer step runs on the
  aggregator: the job's global parameters and outer momentum live there
  (gradq.server.outer_state), charged to its memory budget, and every host
  keeps the same copy by applying the same mean with the same float32
  operations (gradq.client.diloco.on_aggregator). A joiner takes the global
  state from the aggregator, with no donor host; a restarted aggregator is
  seeded again from the hosts' copies; hosts that start from different
  weights all take the first one's. The outer optimizer is SGD with momentum
  (Nesterov or not), read from ``outer_optimizer``.
- With ``outer_step="hosts"`` the aggregator only averages; every host
  applies the mean with its own ``outer_optimizer`` (any torch optimizer), and
  a joiner takes the state from a live host.
- Either way every host holds bit-identical global parameters after every
  outer round.
- A host lost mid-round is dropped by the aggregator, which finishes the round
  over the others. A host dropped because it fell silent (stopped, hung,
  partitioned) and then comes back finds its next push refused: it joins
  again as a joiner and takes the global state, never training on its own.
  A host that joins later receives the global state at the next outer-round
  boundary and is bit-identical from there on: from the aggregator's copy
  (the global parameters and momentum; its inner optimizer starts afresh, as
  every DiLoCo replica's is its own), or with ``outer_step="hosts"`` from a
  live host (the global parameters, the outer optimizer, the round counters,
  its model and inner optimizer).

The modules: ``outer`` (the ``DiLoCo`` loop), ``options`` (its checked
options), ``fragments`` (Streaming DiLoCo's schedule), ``on_aggregator`` and
``on_hosts`` (the two places of the outer step), ``tokens`` (token
weighting), ``joining`` (first Join, catch-up, rejoin) and ``checkpoint``.
``from gradq.client.diloco import DiLoCo``; importing this package loads torch.
"""

from gradq.client.diloco.outer import DEFAULT_BUCKET_ELEMENTS, OUTER_STEP_PLACES, DiLoCo, default_outer_optimizer

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "OUTER_STEP_PLACES", "DiLoCo", "default_outer_optimizer"]
