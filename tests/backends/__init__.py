"""Backends the project's tests point the suite at: correct, and wrong in one way each."""
