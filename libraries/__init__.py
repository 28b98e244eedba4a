"""The set-up one library's lesson needs that is not its lesson (DeepSpeed, Fabric, the Hugging Face
Trainer): above common.py, whose Strategy and Run they build on."""
