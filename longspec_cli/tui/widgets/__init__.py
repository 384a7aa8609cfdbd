"""The monitor's and the wizard's widgets and dialogs: one per module (textual imported here)."""
