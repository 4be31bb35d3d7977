"""The data a run trains on: text and image datasets read on the host (numpy, no jax), the
prefetcher that reads ahead, and the feed that copies each batch to the devices."""
