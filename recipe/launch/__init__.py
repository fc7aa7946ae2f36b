"""From a composed Hydra config to running ranks: environment, local launcher, the Hydra task."""
