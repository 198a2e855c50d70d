"""What a run reports: the metrics logger (`metrics.py`: metrics.jsonl, the plot, the progress bar), the
trackers it hands every logged line to (`trackers.py`: TensorBoard, wandb, trackio, mlflow) and the
generation batch's completions table (`completions_table.py`)."""
