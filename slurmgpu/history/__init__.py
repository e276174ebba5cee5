"""Accounting history: schema, migrations, ingest, spool drain, imports, queries."""
