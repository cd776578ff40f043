"""Service plane of `dsv4flash serve`: API keys and tenants, run ownership, operation ids with bounded
per-tenant queues, and the PolicyServer that admits requests to the service core."""
