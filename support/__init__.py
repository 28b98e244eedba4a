"""What the lessons lean on but do not teach: options and launch (cli), the device (machine), the
models, checkpoints, files, results and measurements, and the set-up one library's lesson needs
(`*_setup`). docs/architecture.md maps each module to its duty."""
