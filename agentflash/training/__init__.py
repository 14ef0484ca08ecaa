"""Training DFlash drafters: the data (`data`), target-regenerated responses (`regenerate`), the
training objective and loop (`dflash`), and fresh drafters in the published format
(`drafter_checkpoint`). tools/train_drafter.py is their command line."""
