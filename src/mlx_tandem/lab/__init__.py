"""The drafter lab: data, training and evaluation of assistant drafters (`tandem distill`)."""
