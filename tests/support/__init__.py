"""Shared test harnesses and fakes: imported by test modules and conftest.py, never a test module itself."""
