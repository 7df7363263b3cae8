"""The host side: the step loop, the scheduler, requests and outputs, the KV block manager, detokenization."""
