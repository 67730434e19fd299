"""Auto-mapping: the cost model and search that choose layouts (HybridFlow, arXiv 2409.19256,
section 6)."""
