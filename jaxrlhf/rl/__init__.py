"""The RLHF loop: rollouts from the generator service, rewards, staleness, weight publishing."""
