"""The worker side of the single controller: Ray worker groups (``group``: one Ray actor per rank,
a torch.distributed world among them, calls dispatched by data-parallel rank), the actor's worker
(``actor``: training engine, rollout engine and reference on each rank), the value-head worker
(``critic``: the critic, reward and cost models), the PPO update loop they share (``updates``)
and the reaper that cleans up after a killed driver."""
