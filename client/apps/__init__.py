"""Applications built on the DDP adapter: `gradq demo`, `gradq worker` (the Compose worker) and their training loop."""
