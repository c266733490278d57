"""Sparse attention over tiered KV (issue 20): a summary per block, kept
apart from the KV, and per decode step and layer a selection of the pages or
blocks that matter.

- accelerator.py: `SparseAccelerator`, the `sparse` entry of `ucm.accelerators`
  (enabled in the YAML file; a connector reaches it by type in its engine
  process's chain) and its options;
- base.py: the selector interface (`Selector`, `Budget`, `LayerStep`, `Selection`);
- summaries.py: a block's key summaries from its bytes through its `KvLayout`;
- index.py: `SummaryIndex`, the summaries by block key in memory;
- mass.py: true and estimated attention mass (GQA), recall;
- lowrank.py: `KeyBasis`, the low-rank key projections `lowrank` scores tokens with;
- units.py: which units are kept, which are candidates, what a budget takes;
- selectors.py: `oracle`, `quest`, `mean`, `moment`, `blend`, `lowrank`, `hybrid`,
  `sinklocal`, `random`.
"""
