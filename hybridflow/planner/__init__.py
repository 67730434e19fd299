"""The planner (HybridFlow, arXiv 2409.19256, section 6): the memory model (``memory``), the cost
model (``cost``) and the search over layouts (``search``), all pure; ``rates`` holds what they read
of a machine (the calibration file's data types); ``calibrate`` and ``profile`` measure it."""
