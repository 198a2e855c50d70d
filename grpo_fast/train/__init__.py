"""The parts of GRPOTrainer's loop: the packed policy forward, rollout batches, scoring, the train step."""
