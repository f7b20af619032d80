"""Draft heads (EAGLE-3, Medusa): the modules, their folder format and their exporters."""
