"""The research studies (README.md): scripts that train models to compare training and distillation choices; each
is run as a script, common.py is what they share."""
