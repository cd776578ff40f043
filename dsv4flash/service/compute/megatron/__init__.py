"""The Megatron trainer backend of `dsv4flash serve --trainer megatron` (docs/service.md, "The compute plane").

| module    | what                                                                                             |
|-----------|--------------------------------------------------------------------------------------------------|
| `layout`  | `ComputePlane` / `TrainerLayout`: the serve flags, parsed without torch                           |
| `cluster` | joining or starting the Ray cluster (`--ray-address`), the workers' environment                  |
| `config`  | veRL's `actor_rollout_ref` config of the group, through the `engine=verl` recipe path              |
| `worker`  | `TinkerPolicyWorker`: veRL's `TinkerActorRolloutRefWorker` with per-policy slots (Ray actor)      |
| `slots`   | one rank's slots: swap a policy's adapter, moments, step, gradients and scaling in and out        |
| `mapping` | Megatron adapter parameters <-> canonical tensors, read off the bridge's export; rank padding     |
| `batch`   | Tinker datums as a veRL batch, and the loss the workers run                                       |
| `group`   | `MegatronGroup`: the driver (admission, calls under one lock, acknowledged slots, restarts)       |
| `client`  | `MegatronTrainingClient`: `TrainingClient` with the group as its trainer backend                  |

Nothing here is imported unless the server runs with `--trainer megatron` (veRL, Ray and Megatron load then).
"""
