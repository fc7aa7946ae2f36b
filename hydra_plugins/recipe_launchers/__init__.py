"""The recipe's Hydra plugins: submitit launchers sized per job, the catalogue sweeper."""
