"""Layer launcher: everything before torchrun (CLI, plans, scripts, checks, the pilot). May
import every other layer and qwentitan.checkpoint; nothing imports it back."""
