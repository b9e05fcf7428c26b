"""Helpers shared by the tests, imported as ``from helpers.<module> import ...``.

pytest puts tests/ on sys.path (``pythonpath`` in pyproject.toml), so these modules import the
same way from every test folder, from subprocesses started with the same sys.path, and from the
worker processes of tensor-parallel tests. Modules: ``models`` (tiny model builders),
``oracle`` (Hugging Face greedy reference), ``generation`` (prompts and greedy runs),
``sequences`` (torch-free Sequence builders), ``engine`` (engine arguments, leak checks,
fault injection), ``sse`` (server-sent events), ``ci`` (skip locally, fail under CI).
"""
