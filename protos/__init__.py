"""pdserve protos package."""
