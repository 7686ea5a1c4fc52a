"""The PD router: the OpenAI API in front of prefill and decode instances."""
