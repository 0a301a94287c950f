"""The three roles: env workers step simulators, rollout workers turn observations into
actions, actor workers train the policy on the trajectories."""
