"""The asyncio references, built the vLLM-Omni way; file names mirror the Trio side they twin."""
