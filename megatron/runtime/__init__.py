"""What the ranks use at run time to find each other and to notice a lost one: the launcher's environment
(dist_env), the network interface (network), the heartbeat and the lost-peer watch. The launch planner
(megatron/launch/) runs before any rank and lives apart."""
