"""The driver of an RL run, as functions over its worker groups: ``groups`` starts them and gives
them typed calls, ``step`` is one iteration, ``loop`` the run (resume, validation, checkpoints,
signals, tracking, summary). ``hybridflow.trainer.RLTrainer`` is its public face."""
