"""What the lessons lean on but do not teach: options (cli), errors, launch, the device (machine), the
models, checkpoints, files, results and measurements (callbacks, measure), and the spawn lessons' set-up
(`spawn_setup`). Nothing here imports common.py or above. docs/architecture.md maps each module to its duty."""
