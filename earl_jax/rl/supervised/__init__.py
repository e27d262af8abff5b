"""A supervised start: the SFT stage on transcripts, the format warm-up's random legal games, expert games for a
base policy and their replay in other prompt styles."""
