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

What a connector imports is this package's surface below, never one of its
modules (tests/unit/accelerators/sparse/test_sparse_surface.py): the
accelerator and its options, the values a selection is made of and
answers, and the few pure functions a connector's own page summaries are
built with (a page's bounds and projections stored as the summaries store
them, a basis fitted, a block's keys summarised, a layer's units read out
of block summaries). Everything a connector configures sparse decode by
comes from the accelerator (`make_selector`, `summary_parts`, `new_index`,
`selection`, `options`).
"""
from ucm.accelerators.sparse.accelerator import SparseAccelerator, SparseOptions
from ucm.accelerators.sparse.base import Budget, LayerStep, Selection, SelectionConfig, Selector, UnitSummaries
from ucm.accelerators.sparse.index import SummaryIndex
from ucm.accelerators.sparse.lowrank import PROJ_DTYPE, KeyBasis, fit_key_basis, store_projections
from ucm.accelerators.sparse.summaries import (BOUND_DTYPE, BlockSummary, SummaryParts, layer_units, store_bounds,
                                               summarize_keys)

__all__ = ["SparseAccelerator", "SparseOptions",
           "Budget", "LayerStep", "Selection", "SelectionConfig", "Selector", "UnitSummaries",
           "SummaryIndex", "SummaryParts", "BlockSummary", "KeyBasis",
           "fit_key_basis", "summarize_keys", "layer_units", "store_bounds", "store_projections",
           "BOUND_DTYPE", "PROJ_DTYPE"]
