"""The command-line job behind experiments/train.py, connect4.py and tictactoe.py: its typed config, the checks
that need more than one field, the pod preset, the run's plots and the selector's profile mode."""
